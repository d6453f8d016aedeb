"""Crash anywhere: SIGKILL `mileage train` at named points and at random instants, rerun the
same command until it exits 0, and every checkpoint tensor and metrics record must equal those
of an uninterrupted run (`mileage.testing.crash`). The built-in model keeps this end-to-end.

Each test is one chain of launches: every launch resumes from what the previous kills left, so
one process start buys one kill event.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mileage.testing.compare import LEFTOVER_DIFF, compare_runs
from mileage.testing.crash import aimed_random_kills, outcome_table, run_with_kills
from mileage.testing.kills import (
    LOOP_POINTS,
    SAVE_POINTS,
    Kill,
    Launch,
    Outcome,
    crash_run_args,
    landed_mid_run,
)

pytestmark = pytest.mark.slow

ARGS = crash_run_args()
ASYNC_ARGS = crash_run_args(async_save=True)

# (kill, rollout it hits, tracker after it): with synchronous saves every kill lands at a known
# place, and each launch resumes where the previous kill left the run. Every gap of the commit
# order (store.py) before the rename is hit while saving rollout 0; after the rename the
# checkpoint is complete, so a kill there (tracker not moved yet) resumes after it: the next
# launch finds the newest complete checkpoint (the plan's discovery) and goes on from there.
SYNC_CHAIN = [
    (Kill.at("rollout_start"), 0, None),  # after the eval before training
    (Kill.at("after_generate"), 0, None),
    (Kill.at("optimizer_step"), 0, None),  # between the two optimizer steps of a rollout
    (Kill.at("save_after_model"), 0, None),  # inside the first checkpoint write
    (Kill.at("save_after_optimizer"), 0, None),
    (Kill.at("save_after_state"), 0, None),
    (Kill.at("save_before_manifest"), 0, None),
    (Kill.at("commit_before_rename"), 0, None),
    (Kill.at("commit_after_rename"), 0, None),  # iter_0 complete, no tracker: resumes at 1
    (Kill.at("tracker_before_replace"), 1, None),  # iter_1 complete, no tracker: resumes at 2
    (Kill.at("commit_after_tracker"), 2, 2),
    (Kill.at("save_after_prune"), 3, 3),
    (Kill.at("after_train"), 4, 3),
    (Kill.at("after_metrics"), 4, 3),  # logged but not saved: the log is cut back
    (Kill.at("commit_before_tracker"), 4, 3),  # complete iter_4 the tracker (3) does not name
    (Kill.at("optimizer_step", 2), 4, 3),  # last step of rollout 4
    (Kill.at("save_after_model"), 4, 3),
    (Kill.at("rollout_start"), 4, 3),  # twice in a row at the same place
    (Kill.at("commit_before_tracker"), 4, 3),
    (Kill.at("after_generate", 2), 5, 4),
    (Kill.at("commit_after_tracker"), 5, 5),  # the rerun finds nothing left to do
]

# With --async-save the main thread runs ahead of the save in flight, so where a kill leaves
# the tracker varies; the hits are chosen so that each kill is reached whichever way it goes.
# A kill before the tracker moves, in the writer thread, leaves the run where it was (or, past
# the rename, after the complete checkpoint it wrote).
ASYNC_CHAIN = [
    Kill.at("save_after_model"),  # in the writer thread, while rollout 1 generates
    Kill.at("save_after_optimizer"),
    Kill.at("save_after_state"),
    Kill.at("save_before_manifest"),
    Kill.at("commit_before_rename"),
    Kill.at("commit_after_rename"),
    Kill.at("tracker_before_replace"),
    Kill.at("save_after_prune"),
    Kill.at("optimizer_step", 3),  # the next rollout's first step, its predecessor's save in flight
    Kill.at("after_metrics"),
    Kill.at("save_after_model"),
    Kill.at("rollout_start"),
    Kill.at("commit_before_tracker"),
    Kill.at("after_train"),
    Kill.at("commit_after_tracker"),
]


def test_the_chains_hit_every_save_point():
    sync_points = {kill.point for kill, _, _ in SYNC_CHAIN}
    assert set(SAVE_POINTS) <= sync_points and set(SAVE_POINTS) <= {k.point for k in ASYNC_CHAIN}
    assert set(LOOP_POINTS) <= sync_points


@pytest.fixture(scope="module")
def reference(crash_reference) -> tuple[Path, Launch]:
    return crash_reference


@pytest.fixture(scope="module")
def reference_async(crash_reference_async) -> Path:
    return crash_reference_async


@pytest.fixture(scope="module")
def sync_chain(reference, tmp_path_factory) -> tuple[list[Outcome], list[str]]:
    save = tmp_path_factory.mktemp("sync_chain") / "run"
    outcomes = run_with_kills(ARGS, save, [kill for kill, _, _ in SYNC_CHAIN])
    return outcomes, compare_runs(reference[0], save)


@pytest.fixture(scope="module")
def async_chain(reference_async, tmp_path_factory) -> tuple[list[Outcome], list[str]]:
    save = tmp_path_factory.mktemp("async_chain") / "run"
    outcomes = run_with_kills(ASYNC_ARGS, save, ASYNC_CHAIN)
    return outcomes, compare_runs(reference_async, save)


def assert_recovered(outcomes: list[Outcome], kills: int, diffs: list[str]) -> None:
    table = outcome_table(outcomes)
    assert len(outcomes) == kills, table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.intact and outcome.resumed, table
    assert diffs == [], table


def test_sync_kills_each_killed_the_process_where_aimed(sync_chain):
    outcomes, _ = sync_chain
    table = outcome_table(outcomes)
    # returncode -9 for every named kill: the comparison below cannot pass vacuously
    assert [o.status for o in outcomes] == ["killed"] * len(SYNC_CHAIN), table
    assert [(o.rollout, o.tracker) for o in outcomes] == [(r, t) for _, r, t in SYNC_CHAIN], table


def test_sync_kills_resume_to_the_uninterrupted_tensors_and_metrics(sync_chain):
    outcomes, diffs = sync_chain
    # leftovers are checked by the next test, not as part of the promise checked here
    assert_recovered(
        outcomes, len(SYNC_CHAIN), [d for d in diffs if not d.startswith(LEFTOVER_DIFF)]
    )


def test_a_finished_run_keeps_no_leftovers_of_interrupted_saves(sync_chain):
    _, diffs = sync_chain
    assert [d for d in diffs if d.startswith(LEFTOVER_DIFF)] == []


def test_async_kills_resume_to_the_uninterrupted_tensors_and_metrics(async_chain):
    outcomes, diffs = async_chain
    assert [o.status for o in outcomes] == ["killed"] * len(ASYNC_CHAIN), outcome_table(outcomes)
    assert_recovered(outcomes, len(ASYNC_CHAIN), diffs)


def test_random_kills_count_from_the_plan_line_over_what_is_left():
    # start-up took 3 s, then 4 rollouts of 1 s: the delays count from each launch's own plan
    # line (CI once saw start-up take longer than the whole reference's training span)
    lines = [(3.0, "plan: fresh start at rollout 0 of 4 (rollouts mode)\n")]
    lines += [(3.0 + r, f"rollout {r} | loss 0.1\n") for r in range(1, 5)]
    stdout = "".join(line for _, line in lines)
    reference = Launch(None, 0, 8.0, stdout, "", stdout_times=lines)
    kills = aimed_random_kills(reference, 3, seed=1)
    first = kills([])
    assert first.after_line == "plan:" and 0.0 <= first.delay <= 0.75 * 4.0
    assert first.label == f"'plan:'+{first.delay:.2f}s"
    # after a kill that left rollout 2 committed, one rollout is left to aim at
    left_one = Outcome(first, reference, rollout=3, tracker=2)
    assert all(kills([left_one]).delay <= 0.75 for _ in range(20))
    with pytest.raises(ValueError, match="after_line"):
        Kill(point="rollout_start", after_line="plan:")


def test_random_time_kills_land_mid_run_and_match_uninterrupted_run(reference, tmp_path):
    save = tmp_path / "run"
    reference_save, reference_launch = reference
    # drawn inside the training span measured on the reference run, aimed at what is left
    kills = aimed_random_kills(reference_launch, 4, seed=20240611)
    outcomes = run_with_kills(ARGS, save, kills)
    table = outcome_table(outcomes)
    landed = [o for o in outcomes if landed_mid_run(o)]
    missed = [o.kill.label for o in outcomes if not landed_mid_run(o)]
    print(f"random-time kills: {len(landed)} of {len(outcomes)} landed mid-run; missed: {missed}")
    # the bar: at least one mid-run kill, and the count reported (timing on a loaded
    # machine can make a later kill land after a resumed launch finished)
    assert landed, f"no kill landed mid-run (missed {missed})\n{table}"
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    assert compare_runs(reference_save, save) == [], table


def test_kill_between_rename_and_tracker_of_first_save_resumes(reference, tmp_path):
    save = tmp_path / "run"
    outcomes = run_with_kills(ARGS, save, [Kill.at("commit_before_tracker")], max_reruns=1)
    assert outcomes[0].died
    assert outcomes[0].resumed, outcomes[0].problems
    assert compare_runs(reference[0], save) == []
