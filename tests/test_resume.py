"""Real `mileage train` runs that stop and resume: start id, LR sequence, data order, tensors.

The exactness tests run the built-in model, which learns, and check that it did before
comparing: a resume that loses the optimizer state or the data position ends with other weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_learned, builtin_train_args, fast_train_args

from mileage.checkpoint.inspect import list_checkpoints
from mileage.metrics import TIMING_KEYS, read_metrics
from mileage.training.optimizer import LRSchedule

# two optimizer steps per rollout, warmup then cosine decay: any double-step or skip shows up
SCHEDULE = [
    "--global-batch-size",
    "16",
    "--micro-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "3",
    "--lr-decay-style",
    "cosine",
    "--rollout-shuffle",
]


def four_rollouts(save) -> list:
    return [
        "train",
        *builtin_train_args(*SCHEDULE),
        "--num-rollout",
        4,
        "--save-interval",
        1,
        "--save",
        save,
        "--load",
        save,
    ]


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def final_digests(save: Path) -> tuple[str, str]:
    last = [r for r in list_checkpoints(save) if r["tracked"]][0]
    return last["model_digest"], last["optimizer_digest"]


def test_second_run_with_load_starts_at_rollout_2(cli, tiny_hf, tmp_path):
    save = tmp_path / "run"
    args = ["train", *fast_train_args(tiny_hf), "--save", save, "--load", save]
    first = cli(*args, "--num-rollout", 2)
    assert first.returncode == 0, first.stderr
    # planned again under the lock, the same decision is not printed a second time
    assert first.stdout.count("plan: fresh start at rollout 0 of 2") == 1
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    second = cli(*args, "--num-rollout", 4)
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("plan: resume at rollout 2 of 4") == 1
    assert "rollout 0 |" not in second.stdout and "rollout 2 |" in second.stdout
    assert [r["rollout_id"] for r in read_metrics(save)] == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def uninterrupted(builtin_model, tmp_path_factory):
    from conftest import run_cli

    save = tmp_path_factory.mktemp("straight")
    done = run_cli(*four_rollouts(save))
    assert done.returncode == 0, done.stderr
    assert_learned(save, builtin_model)
    return save


def test_resume_after_every_rollout_matches_uninterrupted_run(cli, tmp_path, uninterrupted):
    save = tmp_path / "stepwise"
    args = [*four_rollouts(save), "--debug-exit-after-rollout", 1]
    for expected_start in range(4):
        step = cli(*args)
        assert step.returncode == 0, step.stderr
        assert f"at rollout {expected_start} of 4" in step.stdout
    straight, stepwise = read_metrics(uninterrupted), read_metrics(save)
    assert [r["lrs"] for r in stepwise] == [r["lrs"] for r in straight]
    assert [r["prompt_indices"] for r in stepwise] == [r["prompt_indices"] for r in straight]
    schedule = LRSchedule(peak=1e-3, minimum=0.0, warmup=3, decay_style="cosine", decay_steps=8)
    assert [lr for r in straight for lr in r["lrs"]] == [schedule.lr_at(i) for i in range(8)]
    assert comparable(stepwise) == comparable(straight)
    assert final_digests(save) == final_digests(uninterrupted)


def test_resume_rows_run_for_real(cli, tiny_hf, tmp_path):
    """--ckpt-step, --no-load-optim/--no-load-rng, --finetune, explicit start and release, trained."""
    save = tmp_path / "run"
    base = ["train", *fast_train_args(tiny_hf), "--save-interval", 1]
    assert cli(*base, "--num-rollout", 2, "--save", save, "--load", save).returncode == 0
    cases = [
        (["--ckpt-step", 0, "--save", tmp_path / "k"], "resume at rollout 1 of 3"),
        (
            ["--no-load-optim", "--no-load-rng", "--save", tmp_path / "n"],
            "resume at rollout 2 of 3",
        ),
        (["--finetune", "--save", tmp_path / "f"], "fresh start at rollout 0 of 3"),
        (["--start-rollout-id", 1, "--save", tmp_path / "s"], "warning: --start-rollout-id 1"),
    ]
    for extra, expected in cases:
        result = cli(*base, "--num-rollout", 3, "--load", save, *extra)
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout, result.stdout
    release = tmp_path / "rel"
    assert cli("convert", "--hf-checkpoint", tiny_hf, "--save", release).returncode == 0
    from_release = cli(*base, "--num-rollout", 1, "--load", release, "--save", release)
    assert from_release.returncode == 0, from_release.stderr
    assert "fresh start at rollout 0 of 1" in from_release.stdout
    assert (release / "iter_0000000").is_dir()
