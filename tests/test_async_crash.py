"""train-async resumes exactly: staleness 0 equals `mileage train`, and SIGKILL anywhere in a
one-step-off or fully async run (while rollout N+1 generates during N's training, in the middle
of a weight sync, at every gap of the commit) or SIGTERM, with the in-process engine and with
`mileage serve`, ends with every tensor and metrics record of an uninterrupted async run with
the same flags, and the same prompts trained in the same order.

Each chain is one sequence of launches: every launch resumes from what the previous kills left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_learned

from mileage.preemption import STOPPED_EXIT
from mileage.testing.compare import TENSOR_DIFF, compare_runs
from mileage.testing.crash import (
    aimed_random_kills,
    launch,
    outcome_table,
    run_uninterrupted,
    run_with_kills,
)
from mileage.testing.kills import ASYNC_POINTS, Kill, Outcome, crash_run_args, landed_mid_run
from mileage.testing.servers import start_servers

pytestmark = pytest.mark.slow

ASYNC = "train-async"
ONE_STEP_ARGS = crash_run_args()
# fully async with a bound the interval exceeds: slot 2 is generated with weights 2 updates
# old, so its groups go back to the data (retry) and are generated again with newer weights
FULLY_ARGS = [
    *crash_run_args(),
    "--fully-async",
    "--max-weight-staleness", "1",
    "--update-weights-interval", "2",
    "--async-unused-samples-handler", "retry",
]  # fmt: skip

ONE_STEP_CHAIN = [
    Kill.at("async_generating", 2),  # slot 1 generating while rollout 0 trains
    Kill.at("mid_weight_sync", 2),  # the 1st is the sync at start; the 2nd after rollout 0
    Kill.at("before_weight_sync"),
    Kill.at("save_after_model"),
    Kill.at("commit_before_rename"),
    Kill.at("tracker_before_replace"),
    Kill.at("commit_after_tracker"),  # iter_0 committed with slot 1 in its rollout buffer
    Kill.at("async_generating"),  # slot 2 generating while rollout 1 (from the buffer) trains
    Kill.at("optimizer_step", 3),
    Kill.at("save_after_state"),
    Kill.at("commit_after_rename"),
    Kill.at("after_metrics", 2),
    Kill.at("save_before_manifest", 2),
    Kill.at("save_after_prune"),
]

# --keep-old-actor: each checkpoint also holds the weights its buffered slot was generated with
# --no-fp32-lm-head: the engine's arithmetic is then the trainer's in bf16 too, so a
# denominator of the right weights matches the engine's log-probs to kernel rounding
KEEP_ARGS = [*crash_run_args(num_rollout=4), "--keep-old-actor", "--no-fp32-lm-head"]
KEEP_CHAIN = [
    Kill.at("commit_after_tracker"),  # iter_0 committed with slot 1 and version 0's weights
    Kill.at("async_generating"),  # slot 2 generating while rollout 1 trains on the kept ones
    Kill.at("save_after_state", 2),
]

FULLY_CHAIN = [
    Kill.at("async_generating", 2),
    Kill.at("commit_before_tracker", 2),
    Kill.at("mid_weight_sync", 2),
    Kill.at("save_after_optimizer", 2),
    Kill.at("after_generate", 2),  # after the stale groups were retried, before training
]


def rollout_records(save: Path) -> list[dict]:
    """The per-rollout records of metrics.jsonl (the evaluation before training, rollout -1,
    is a record of its own, with no prompts or staleness)."""
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["rollout_id"] >= 0]


def trained_prompts(save: Path) -> list[list[int]]:
    return [r["prompt_indices"] for r in rollout_records(save)]


def assert_recovered(outcomes: list[Outcome], diffs: list[str]) -> None:
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(outcomes), table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.intact and outcome.resumed, table
    assert diffs == [], table


@pytest.fixture(scope="module")
def one_step_reference(builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("one_step_ref") / "run"
    done = run_uninterrupted(ONE_STEP_ARGS, save, subcommand=ASYNC)
    assert_learned(save, builtin_model)
    return save, done


def test_the_chains_hit_the_async_points():
    assert set(ASYNC_POINTS) <= {k.point for k in ONE_STEP_CHAIN}


def test_staleness_zero_is_train_tensor_for_tensor(crash_reference, tmp_path):
    sync_save, _ = crash_reference
    save = tmp_path / "run"
    args = [*crash_run_args(), "--fully-async", "--max-weight-staleness", "0"]
    run_uninterrupted(args, save, subcommand=ASYNC)
    diffs = compare_runs(sync_save, save)
    assert not [d for d in diffs if d.startswith(TENSOR_DIFF)], diffs
    # what may differ: the async run's rollout buffer (empty here) and its staleness metrics
    allowed = ("trainer_state.json: rollout_buffer differs", "staleness_max, staleness_mean")
    assert all(any(a in d for a in allowed) for d in diffs), diffs
    assert trained_prompts(save) == trained_prompts(sync_save)


def test_one_step_off_trains_every_prompt_once_in_data_order(one_step_reference, crash_reference):
    save, _ = one_step_reference
    records = rollout_records(save)
    assert [r["staleness_max"] for r in records] == [0, 1, 1, 1, 1, 1]
    # the same data order as synchronous training: nothing skipped, nothing repeated
    assert trained_prompts(save) == trained_prompts(crash_reference[0])


def test_one_step_off_stopped_and_rerun_equals_the_uninterrupted_run(
    one_step_reference, cli, tmp_path
):
    reference, _ = one_step_reference
    save = tmp_path / "run"
    first = launch([*ONE_STEP_ARGS, "--debug-exit-after-rollout", "2"], save, subcommand=ASYNC)
    assert first.returncode == 0, first.tail()
    # `mileage plan` says beforehand what the resume will take from the buffer
    plan = cli("plan", *ONE_STEP_ARGS, "--save", save, "--load", save)
    assert plan.returncode == 0, plan.stderr
    assert "reuses 1 pre-generated rollout (32 samples, weight version 2)" in plan.stdout
    rerun = launch(ONE_STEP_ARGS, save, subcommand=ASYNC)
    assert rerun.returncode == 0, rerun.tail()
    # iter_1 holds slot 2, generated during rollout 1 with the weights of rollout 0's update
    assert "reuses 1 pre-generated rollout (32 samples, weight version 2)" in rerun.stdout
    assert compare_runs(reference, save) == []


def test_one_step_off_kills_resume_to_the_uninterrupted_async_run(one_step_reference, tmp_path):
    reference, _ = one_step_reference
    save = tmp_path / "run"
    outcomes = run_with_kills(ONE_STEP_ARGS, save, ONE_STEP_CHAIN, subcommand=ASYNC)
    assert_recovered(outcomes, compare_runs(reference, save))
    assert trained_prompts(save) == trained_prompts(reference)


def test_one_step_off_random_instant_kills(one_step_reference, tmp_path):
    reference, reference_launch = one_step_reference
    save = tmp_path / "run"
    kills = aimed_random_kills(reference_launch, 2, seed=17)
    outcomes = run_with_kills(ONE_STEP_ARGS, save, kills, subcommand=ASYNC)
    table = outcome_table(outcomes)
    assert any(landed_mid_run(o) for o in outcomes), table
    assert all(not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table


def test_fully_async_kills_resume_to_the_uninterrupted_async_run(builtin_model, tmp_path):
    reference = tmp_path / "reference"
    run_uninterrupted(FULLY_ARGS, reference, subcommand=ASYNC)
    assert_learned(reference, builtin_model)
    records = rollout_records(reference)
    assert sum(r["stale_groups"] for r in records) > 0  # the handler was exercised
    save = tmp_path / "run"
    outcomes = run_with_kills(FULLY_ARGS, save, FULLY_CHAIN, subcommand=ASYNC)
    assert_recovered(outcomes, compare_runs(reference, save))
    # retried groups are trained later, never lost: every prompt drawn is trained exactly once
    flat = [i for batch in trained_prompts(save) for i in batch]
    assert len(flat) == len(set(flat))


@pytest.fixture(scope="module")
def serve_args(builtin_model):
    (server,) = start_servers(builtin_model, 1)
    yield [*crash_run_args(), "--rollout-engine", "sglang", "--rollout-url", server.url]
    server.stop()


# composition row 34 trains a critic too (PPO with GAE): one-step-off with critic PPO
PPO_ARGS = ["--advantage-estimator", "ppo", "--normalize-advantages", "--lambd", "0.95"]


def test_serve_engine_kills_and_sigterm_resume_exactly(serve_args, builtin_model, tmp_path):
    serve_args = [*serve_args, *PPO_ARGS]
    reference = tmp_path / "reference"
    run_uninterrupted(serve_args, reference, subcommand=ASYNC)
    assert_learned(reference, builtin_model)
    save = tmp_path / "run"
    # SIGTERM while rollout 0 trains and slot 1 generates on the server: saves, exits 75
    signal_env = {"MILEAGE_SIGNAL_AT": "optimizer_step:SIGTERM:1"}
    stopped = launch(serve_args, save, env=signal_env, subcommand=ASYNC)
    assert stopped.returncode == STOPPED_EXIT, stopped.tail()
    assert "stopped after rollout 0 (SIGTERM); rerun the same command" in stopped.stdout
    chain = [
        Kill.at("async_generating", 2),  # slot 2 generating on the server while rollout 1 trains
        Kill.at("mid_weight_sync", 2),  # written for the server, not yet loaded by it
        Kill.at("commit_before_tracker", 2),
    ]
    outcomes = run_with_kills(serve_args, save, chain, subcommand=ASYNC)
    # the first resume reuses slot 1, generated before the SIGTERM with the starting weights
    assert "reuses 1 pre-generated rollout (32 samples" in outcomes[0].launch.stdout
    assert_recovered(outcomes, compare_runs(reference, save))


def test_train_async_continues_a_checkpoint_of_train(crash_reference, tmp_path):
    import shutil

    save = tmp_path / "run"
    shutil.copytree(crash_reference[0], save)
    args = [*crash_run_args(num_rollout=8)]
    done = launch(args, save, subcommand=ASYNC)
    assert done.returncode == 0, done.tail()
    assert "resume at rollout 6 of 8" in done.stdout and "reuses" not in done.stdout
    records = rollout_records(save)
    # nothing was generated ahead by `train`: rollout 6 is generated with the trainer's weights
    assert [r["staleness_max"] for r in records[6:]] == [0, 1]
    assert "staleness_max" not in records[5]


def test_concurrent_generation_trains_the_same_as_one_slot_at_a_time(builtin_model, tmp_path):
    # two rollouts generate at once on the engine (and overlap training): every slot is seeded
    # by its own index, so what trains does not depend on what generated beside it, or when
    args = [*crash_run_args(num_rollout=4), "--fully-async", "--max-weight-staleness", "2"]
    one = tmp_path / "one"
    run_uninterrupted(args, one, subcommand=ASYNC)
    assert_learned(one, builtin_model)
    two = tmp_path / "two"
    run_uninterrupted([*args, "--async-max-concurrent-samples", "64"], two, subcommand=ASYNC)
    assert compare_runs(one, two) == []
    records = rollout_records(one)
    assert [r["staleness_max"] for r in records] == [0, 1, 2, 2]


def test_keep_old_actor_kills_resume_to_the_uninterrupted_run(
    one_step_reference, builtin_model, cli, tmp_path
):
    reference = tmp_path / "reference"
    run_uninterrupted(KEEP_ARGS, reference, subcommand=ASYNC)
    assert_learned(reference, builtin_model)
    records = rollout_records(reference)
    assert [r["staleness_max"] for r in records] == [0, 1, 1, 1]
    # the denominator is recomputed with the weights that generated each sample: it matches
    # the engine's log-probs of those weights up to kernel rounding (bf16: up to 2.9e-4 on an
    # Intel Xeon with AMX, ~1e-7 on an AMD EPYC), where the trainer's current weights (the
    # decoupled run's proximal policy) are a whole update away (0.17 to 0.26 there)
    decoupled = rollout_records(one_step_reference[0])
    for kept, proximal in zip(records[1:], decoupled[1:4], strict=True):
        assert kept["logprob_abs_diff"] < 1e-3 < proximal["logprob_abs_diff"]
    assert (reference / "iter_0000002" / "old_actor.safetensors").is_file()
    plan = cli("plan", *KEEP_ARGS, "--save", reference, "--load", reference, "--ckpt-step", "1")
    assert plan.returncode == 0, plan.stderr
    assert "reuses 1 pre-generated rollout" in plan.stdout
    assert "kept old-actor weights after 1 trained rollout(s)" in plan.stdout
    save = tmp_path / "run"
    outcomes = run_with_kills(KEEP_ARGS, save, KEEP_CHAIN, subcommand=ASYNC)
    assert_recovered(outcomes, compare_runs(reference, save))
    assert trained_prompts(save) == trained_prompts(reference)


def test_keep_old_actor_refuses_a_checkpoint_without_the_old_weights(one_step_reference, tmp_path):
    import shutil

    from mileage.checkpoint.store import write_tracker

    save = tmp_path / "run"
    shutil.copytree(one_step_reference[0], save)
    for later in ("iter_0000003", "iter_0000004", "iter_0000005"):
        shutil.rmtree(save / later)
    write_tracker(save, 2)  # iter_2 holds slot 3, generated with version 2, not its weights
    done = launch([*ONE_STEP_ARGS, "--keep-old-actor"], save, subcommand=ASYNC)
    assert done.returncode == 2, done.tail()
    (line,) = done.stderr.strip().splitlines()
    assert "weight version(s) 2 but not those weights" in line, line
