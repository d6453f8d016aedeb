"""`--async-save` under torchrun, on 2 CPU ranks (gloo) with the built-in model.

Every rank stages its shards on the main thread, then a background thread per rank writes them
(its DCP collectives on a gloo group of its own) and rank 0 commits with the one tracker move.
One uninterrupted N=2 run with --async-save is the reference; it must have learned, and its
checkpoints must equal a synchronous N=2 run's tensor for tensor (the staged copy is what
training had at the save, not what it changed to while the thread wrote). Against it, a crash
chain kills either rank inside the background save (shards half written, staging complete but
not renamed, renamed but not tracked, tracked) and reruns the same command: every tensor, the
trainer state and the metrics equal the reference's.
"""

from __future__ import annotations

import pytest
from conftest import assert_learned, torchrun_env

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.store import verify_checkpoint
from mileage.testing.compare import compare_checkpoints, compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill, Outcome

pytestmark = pytest.mark.slow

NPROC = 2
NUM_ROLLOUT = 3
ARGS = [
    "--num-rollout", str(NUM_ROLLOUT),
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
]  # fmt: skip
ASYNC = [*ARGS, "--async-save"]

# (kill, tracker after it). Hit counts restart with every launch; the main thread runs ahead
# of the save in flight, so only the tracker a kill leaves is fixed, not the rollout it hits.
CHAIN = [
    (Kill.at("save_after_model", rank=1), None),  # rank 1's model shard written, in the thread
    (Kill.at("save_after_optimizer", rank=0), None),
    (Kill.at("commit_before_rename", rank=0), None),  # staging complete, hashed, not renamed
    (Kill.at("commit_after_tracker", rank=0), 0),
    (Kill.at("save_after_model", rank=0), 0),  # rollout 1's save
    (Kill.at("commit_before_tracker", rank=0), 0),  # a complete iter_1 the tracker misses
]


@pytest.fixture(scope="module")
def async_reference(builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("dist_async_reference") / "run"
    launch = run_uninterrupted(ASYNC, save, nproc=NPROC, env=torchrun_env(), timeout=300)
    assert_learned(save, builtin_model)
    return save, launch


def test_n2_async_save_writes_what_a_sync_save_writes(async_reference, tmp_path):
    save, launch = async_reference
    assert "--async-save" not in launch.stderr  # not refused
    sync = tmp_path / "sync"
    run_uninterrupted(ARGS, sync, nproc=NPROC, env=torchrun_env(), timeout=300)
    assert read_tracker(save).iteration == NUM_ROLLOUT - 1
    for rollout_id in range(NUM_ROLLOUT):
        path = checkpoint_path(save, rollout_id)
        assert verify_checkpoint(path) == []
        assert compare_checkpoints(checkpoint_path(sync, rollout_id), path) == []
    assert not [p for p in save.iterdir() if p.name.startswith(".staging")]


@pytest.fixture(scope="module")
def async_chain(async_reference, tmp_path_factory) -> tuple[list[Outcome], list[str]]:
    save = tmp_path_factory.mktemp("dist_async_chain") / "run"

    def next_kill(outcomes: list[Outcome]) -> Kill | None:
        last = outcomes[-1] if outcomes else None
        if last is not None and not last.died and last.problems:
            return None
        return CHAIN[len(outcomes)][0] if len(outcomes) < len(CHAIN) else None

    outcomes = run_with_kills(
        ASYNC, save, next_kill, max_reruns=2, nproc=NPROC, env=torchrun_env(), timeout=300
    )
    return outcomes, compare_runs(async_reference[0], save)


def test_n2_kills_mid_async_save_resume_to_the_uninterrupted_run(async_chain):
    outcomes, diffs = async_chain
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    assert [o.tracker for o in outcomes] == [t for _, t in CHAIN], table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.intact and outcome.resumed, table
    assert diffs == [], table
