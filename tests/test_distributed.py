"""torchrun + FSDP2 end to end, on 2 CPU ranks (gloo) with the built-in model.

One uninterrupted N=2 run is the reference. Against it: a crash chain at N=2 (SIGKILL of rank 0
or rank 1 at named points, rerun of the same torchrun command, every tensor `torch.equal`), a
resume at N=1, a reload-and-resave at N=1 and at N=2 (the loaded tensors must equal the saved
ones bit for bit, and `ckpt ls` digests must not depend on the world size), SIGTERM, the lock.
In-process tests cover the pure pieces (shares, micro-batches, the plan's world-size row).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from mileage.checkpoint.layout import META, TRACKER, checkpoint_path, read_tracker
from mileage.checkpoint.lock import SaveDirLock
from mileage.checkpoint.plan import RESUME, StartFlags, plan_start
from mileage.checkpoint.store import (
    MODEL_DIR,
    OPTIMIZER_DIR,
    TRAINER_STATE,
    load_tensors,
    verify_checkpoint,
)
from mileage.distributed import env
from mileage.distributed.checkpoint import gather_rng, rng_of_this_rank
from mileage.metrics import METRICS_FILE, read_metrics
from mileage.models.tiny import ensure_builtin_model
from mileage.testing.compare import compare_runs, compare_tensors
from mileage.testing.crash import (
    Kill,
    Outcome,
    outcome_table,
    run_uninterrupted,
    run_with_kills,
    train_command,
)

NPROC = 2
# two optimizer steps per rollout (global batch 16 of 32 samples: 8 per rank), warmup then
# cosine LR, shuffled prompts
ARGS = [
    "--num-rollout", "3",
    "--rollout-batch-size", "8",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "16",
    "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
]  # fmt: skip

# (kill, rollout it hits, tracker after it). Points inside the commit after the shards are
# written run on rank 0 only; the others are aimed at either rank. A surviving rank runs on
# until its next collective, so a kill of rank 1 is aimed where that cannot log a rollout.
CHAIN = [
    (Kill.at("rollout_start", rank=1), 0, None),
    (Kill.at("after_generate", rank=0), 0, None),
    (Kill.at("optimizer_step", rank=1), 0, None),
    (Kill.at("save_after_model", rank=1), 0, None),  # rank 1's shards written, rank 0's maybe
    (Kill.at("commit_before_rename", rank=0), 0, None),
    (Kill.at("commit_after_tracker", rank=0), 0, 0),
    # rank 0 itself: killed on rank 1 here, rank 0 may log rollout 1 before it notices
    (Kill.at("after_train", rank=0), 1, 0),
    (Kill.at("after_metrics", rank=0), 1, 0),  # logged, not saved: the log is cut back
    (Kill.at("commit_before_tracker", rank=0), 1, 0),  # complete iter_1 the tracker misses
    (Kill.at("optimizer_step", 2, rank=0), 1, 0),  # the second step of rollout 1
    (Kill.at("save_after_model", rank=0), 1, 0),
]

pytestmark = pytest.mark.slow


def torchrun_env() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def builtin_model(mileage_home) -> Path:
    with torch.random.fork_rng():
        return ensure_builtin_model("addition")


@pytest.fixture(scope="module")
def reference(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("dist_reference") / "run"
    run_uninterrupted(ARGS, save, nproc=NPROC, env=torchrun_env(), timeout=300)
    return save


def resave(load: Path, save: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    """Load `load`'s checkpoint as a resume would, save it again at world size `nproc`."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    command = [
        sys.executable,
        *(launcher if nproc > 1 else []),
        "-m",
        "mileage.testing.resave",
        *ARGS,
        "--load", str(load),
        "--save", str(save),
        *extra,
    ]  # fmt: skip
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# ---------------------------------------------------------------- N=2 training and checkpoints


def test_n2_run_writes_every_ranks_shards_and_commits_once(reference):
    for rollout_id in range(3):
        path = checkpoint_path(reference, rollout_id)
        assert verify_checkpoint(path) == []
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            assert sorted(p.name for p in (path / sub).glob("*.distcp")) == [
                "__0_0.distcp",
                "__1_0.distcp",
            ]
        assert json.loads((path / META).read_text())["world_size"] == NPROC
    assert read_tracker(reference).iteration == 2
    records = read_metrics(reference)
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert [r["global_step"] for r in records] == [2, 4, 6]
    assert not [p for p in reference.iterdir() if p.name.startswith(".staging")]


@pytest.mark.parametrize("nproc", [1, 2])
def test_reload_at_any_world_size_gives_the_saved_tensors_bit_for_bit(reference, tmp_path, nproc):
    copy = tmp_path / f"resaved_{nproc}"
    resave(reference, copy, nproc, "--ckpt-step", "1")
    original, again = checkpoint_path(reference, 1), checkpoint_path(copy, 1)
    for sub in (MODEL_DIR, OPTIMIZER_DIR):
        tensors = load_tensors(original / sub)
        assert len(tensors) > 10
        assert compare_tensors(sub, tensors, load_tensors(again / sub)) == []
    assert json.loads((again / TRAINER_STATE).read_text()) == json.loads(
        (original / TRAINER_STATE).read_text()
    )
    assert json.loads((again / META).read_text())["world_size"] == nproc
    listing = {}
    for save in (reference, copy):
        out = subprocess.run(
            [sys.executable, "-m", "mileage", "ckpt", "ls", str(save), "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        rows = {row["rollout_id"]: row for row in json.loads(out.stdout)}
        listing[save] = (rows[1]["model_digest"], rows[1]["optimizer_digest"])
    assert listing[reference] == listing[copy]
    assert None not in listing[copy]


def test_n2_checkpoint_resumes_at_n1_with_exact_position_and_lr(reference, tmp_path):
    save = tmp_path / "at_n1"
    shutil.copytree(reference, save)
    shutil.rmtree(checkpoint_path(save, 2))
    (save / TRACKER).write_text("1\n")
    done = subprocess.run(
        train_command(ARGS, save),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size changed: saved by 2 process(es), resuming with 1" in done.stdout
    ours, theirs = read_metrics(save), read_metrics(reference)
    assert [r["rollout_id"] for r in ours] == [0, 1, 2]
    for key in ("prompt_indices", "lrs", "global_step"):
        assert ours[2][key] == theirs[2][key], key
    assert json.loads((checkpoint_path(save, 2) / META).read_text())["world_size"] == 1


# ---------------------------------------------------------------- crash anywhere at N=2


@pytest.fixture(scope="module")
def chain(reference, tmp_path_factory) -> tuple[list[Outcome], list[str]]:
    save = tmp_path_factory.mktemp("dist_chain") / "run"
    outcomes = run_with_kills(
        ARGS,
        save,
        [kill for kill, _, _ in CHAIN],
        nproc=NPROC,
        env=torchrun_env(),
        timeout=300,
    )
    return outcomes, compare_runs(reference, save)


def test_n2_kills_each_killed_a_rank_where_aimed(chain):
    outcomes, _ = chain
    table = outcome_table(outcomes)
    assert len(CHAIN) >= 10
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    assert [(o.rollout, o.tracker) for o in outcomes] == [(r, t) for _, r, t in CHAIN], table


def test_n2_kills_resume_to_the_uninterrupted_tensors_and_metrics(chain):
    outcomes, diffs = chain
    table = outcome_table(outcomes)
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.intact and outcome.resumed, table
    assert diffs == [], table


# ---------------------------------------------------------------- signals and the lock


def test_sigterm_to_torchrun_saves_on_all_ranks_and_they_exit_0(builtin_model, tmp_path):
    save = tmp_path / "term"
    args = [*ARGS[:1], "50", *ARGS[2:]]  # long enough to be stopped halfway
    proc = subprocess.Popen(
        train_command(args, save, NPROC),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(save) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert read_metrics(save), "no rollout finished in time"
        proc.send_signal(signal.SIGTERM)  # torchrun alone; it forwards SIGTERM to every rank
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    logged = read_metrics(save)[-1]["rollout_id"]
    assert f"stopped after rollout {logged} (SIGTERM)" in stdout, stderr[-2000:]
    assert read_tracker(save).iteration == logged
    assert verify_checkpoint(checkpoint_path(save, logged)) == []
    # both workers exited 0; torchrun itself reports the signal it got (exit code 1)
    assert "exitcode  : -" not in stderr and "exitcode  : 1" not in stderr, stderr[-2000:]


def test_second_torchrun_job_on_a_save_in_use_exits_2_on_every_rank(builtin_model, tmp_path):
    save = tmp_path / "locked"
    with SaveDirLock(save):
        done = subprocess.run(
            train_command(ARGS, save, NPROC),
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **torchrun_env()},
            cwd=REPO,
        )
    assert done.returncode == 1  # torchrun's code for failed workers
    assert done.stderr.count("is in use by another mileage run") == NPROC, done.stderr[-2000:]
    assert done.stderr.count("exitcode  : 2") >= 1
    assert not (save / METRICS_FILE).exists()


# ---------------------------------------------------------------- pure pieces, in process


def test_shares_cover_every_item_once_in_order():
    for count in range(0, 11):
        for parts in (1, 2, 3, 4):
            ranges = [env.share(count, parts, i) for i in range(parts)]
            assert [i for r in ranges for i in r] == list(range(count))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_single_process_micro_batches_are_the_old_ones():
    assert env.micro_batches(16, 16, 4) == [(16, 20), (20, 24), (24, 28), (28, 32)]


def test_plan_names_a_world_size_change_and_only_then(tmp_path):
    from mileage.checkpoint.layout import CheckpointInfo, DirState, parse_tracker
    from mileage.checkpoint.plan import DiskState

    info = CheckpointInfo(str(tmp_path / "iter_0000003"), True, "", {"world_size": 2})
    state = DirState(
        str(tmp_path),
        True,
        tracker=parse_tracker("3"),
        checkpoints={3: info},
    )
    disk = DiskState(state, state, None, None, None)
    for world, changed in ((2, False), (1, True), (4, True)):
        flags = StartFlags("hf", 10, load=str(tmp_path), save=str(tmp_path), world_size=world)
        plan = plan_start(flags, disk)
        assert plan.action == RESUME and plan.start_rollout_id == 4
        said = [r for r in plan.reasons if r.startswith("world size changed")]
        assert bool(said) == changed, plan.reasons


def test_rng_of_each_rank_round_trips_and_fewer_ranks_fall_back_to_rank_0(monkeypatch):
    saved = {"torch_cpu": torch.tensor([1]), "rank1.torch_cpu": torch.tensor([2])}
    monkeypatch.setenv("RANK", "1")
    assert torch.equal(rng_of_this_rank(saved)["torch_cpu"], torch.tensor([2]))
    monkeypatch.setenv("RANK", "3")
    assert torch.equal(rng_of_this_rank(saved)["torch_cpu"], torch.tensor([1]))
    monkeypatch.setenv("RANK", "0")
    assert gather_rng({"torch_cpu": torch.tensor([1])}).keys() == {"torch_cpu"}
