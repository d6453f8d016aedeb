"""W&B (offline) and TensorBoard across a kill and a resume: one point per rollout, one W&B run.

The offline .wandb files are read back with `mileage.tracking.read_wandb_history`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fast_train_args

from mileage.errors import UserError
from mileage.metrics import TIMING_KEYS
from mileage.tracking import (
    TrackingConfig,
    check_tracking,
    offline_run_files,
    read_wandb_history,
    wandb_step,
)


@pytest.fixture
def offline_env(tmp_path) -> dict:
    # no network: an attempt to reach a server would fail on this address
    return {
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
    }


def train_args(tiny_hf, save: Path, wandb_dir: Path, num_rollout: int) -> list:
    return fast_train_args(
        tiny_hf,
        *("--num-rollout", num_rollout, "--save-interval", 2, "--save", save, "--load", save),
        *("--use-wandb", "--wandb-mode", "offline", "--wandb-dir", wandb_dir),
        *("--wandb-project", "mileage-test", "--wandb-group", "kills", "--use-tensorboard"),
        "--weight-decay",
        "0.1",
        # a constant LR: the resumed run raises --num-rollout, which would stretch a decay
        *("--lr-decay-style", "constant"),
    )


def wandb_points(wandb_dir: Path, save: Path, last: int) -> tuple[list[Path], list[tuple]]:
    """The run id the checkpoint holds, its offline files, and every (step, reward) logged."""
    trainer = json.loads((save / f"iter_{last:07d}" / "trainer_state.json").read_text())
    run_id = trainer["tracking"]["wandb_run_id"]
    files = offline_run_files(wandb_dir / "wandb", run_id)
    rows = [(step, row) for f in files for step, row in read_wandb_history(f)]
    # the charts' x-axis: rollout N is W&B step N+1 (step 0: the evaluation before training)
    assert all(wandb_step(row) == step for step, row in rows)
    return files, [(step, row["reward_mean"]) for step, row in rows]


def metrics(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").open()]


def test_killed_and_resumed_offline_wandb_run_has_one_point_per_rollout(
    cli, tiny_hf, tmp_path, offline_env
):
    save, wandb_dir = tmp_path / "run", tmp_path / "wandb-files"
    args = train_args(tiny_hf, save, wandb_dir, 4)
    # killed after rollout 2's metrics are logged; the last checkpoint is rollout 1
    killed = cli("train", *args, env={**offline_env, "MILEAGE_KILL_AT": "after_metrics:3"})
    assert killed.returncode == -9, killed.stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resumed = cli("train", *args, env=offline_env)
    assert resumed.returncode == 0, resumed.stderr

    files, points = wandb_points(wandb_dir, save, 3)
    assert len(files) == 2  # one offline directory per process, both of the same W&B run
    assert sorted(step for step, _ in points) == [1, 2, 3, 4]
    assert sorted(points) == [(wandb_step(r), r["reward_mean"]) for r in metrics(save)]

    # A writer killed mid-record leaves a torn tail (here the killed process's file held only
    # its header: W&B had not flushed). W&B's reader keeps the whole records before the tear,
    # which the resume relies on; a file it cannot read at all is one line, not a crash.
    complete = files[1].read_bytes()
    whole = read_wandb_history(files[1])
    torn = tmp_path / "torn" / files[1].parent.name / files[1].name
    torn.parent.mkdir(parents=True)
    # through the last record naming "_step": W&B writes a row's summary, then its history row
    torn.write_bytes(complete[: complete.rfind(b"_step")])
    cut = read_wandb_history(torn)
    assert len(cut) == len(whole) - 1 and cut == whole[:-1]
    torn.write_bytes(b"not a W&B transaction log" * 100)
    with pytest.raises(UserError, match="could not read .*: Error: .*move that directory away"):
        read_wandb_history(torn)


def test_offline_mode_needs_the_pinned_wandb(monkeypatch):
    import mileage.tracking as tracking

    monkeypatch.setattr(tracking, "installed_wandb_version", lambda: "0.30.2")
    cfg = TrackingConfig(use_wandb=True, wandb_mode="offline")
    with pytest.raises(UserError, match="wandb 0.30.2 is installed: pip install 'wandb==0.31.0'"):
        check_tracking(cfg)
    check_tracking(TrackingConfig(use_wandb=True, wandb_mode="online"))  # reads no files back
    monkeypatch.setattr(tracking, "installed_wandb_version", lambda: "0.31.1")
    check_tracking(cfg)


def test_points_logged_past_the_checkpoint_are_kept_not_repeated(
    cli, tiny_hf, tmp_path, offline_env
):
    """W&B already holds rollouts 2 and 3 when the run resumes from checkpoint 1."""
    save, wandb_dir = tmp_path / "run", tmp_path / "wandb-files"
    first = cli("train", *train_args(tiny_hf, save, wandb_dir, 4), env=offline_env)
    assert first.returncode == 0, first.stderr
    first_metrics = metrics(save)
    # as if killed just before the commit of rollout 3's checkpoint
    for path in sorted((save / "iter_0000003").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (save / "iter_0000003").rmdir()
    (save / "latest_checkpointed_iteration.txt").write_text("1")

    resumed = cli("train", *train_args(tiny_hf, save, wandb_dir, 5), env=offline_env)
    assert resumed.returncode == 0, resumed.stderr
    files, points = wandb_points(wandb_dir, save, 4)
    assert len(files) == 2
    assert [step for step, _ in points] == [1, 2, 3, 4, 5]  # 3 and 4 from the first process
    final = metrics(save)
    assert final[:4] == [
        {**r, **{k: final[i][k] for k in TIMING_KEYS & r.keys()}}
        for i, r in enumerate(first_metrics)
    ]
    assert points == [(wandb_step(r), r["reward_mean"]) for r in final]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    # once each: the resumed process hides the first one's points past the checkpoint
    assert [e.step for e in events.Scalars("reward_mean")] == [0, 1, 2, 3, 4]
