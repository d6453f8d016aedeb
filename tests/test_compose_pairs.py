"""Rows of the composition matrix (docs/composition.md) that cover the pairs no other row has:
a user's rollout function, fully async with everything beside it, and partial rollout with LoRA
and a critic. Each row is killed at least twice and must land on its uninterrupted run.

- Row 45: `train` with `--rollout-function-path` (tests/user_rollout.py: it filters groups and
  draws further prompts itself, so the data position it leaves depends on what was sampled).
- Row 46: `train-async --fully-async` under torchrun (N=2) through a `mileage serve` server with
  LoRA, critic PPO, dynamic sampling's filter and multi-turn tools.
- Row 47: `train` with partial rollout, dynamic sampling, LoRA and critic PPO.

`scripts/composition_pairs.py` checks that with these rows every pair of the matrix's factors
is run under kills or refused for a reason written in docs/composition.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import torchrun_env

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.rollout.dynamic import MILES_NONZERO_STD
from mileage.testing.compare import LEFTOVER_DIFF, compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import PPO_CRITIC_ARGS, Kill
from mileage.testing.servers import start_servers

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
SMALL = [
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
]  # fmt: skip
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear"]
PPO = PPO_CRITIC_ARGS  # the crash harness's critic flags, without its batch sizes
TOOLS = [
    "--generate-tool-call-parser", "odd_digit",
    "--generate-max-turns", "3",
    "--tool-timeout", "1",
    # deterministic answers: the killed chain is compared with a separate uninterrupted run
    # (the random tool's journal is proven against the killed process's own samples, rows 16
    # and test_compose.py)
    "--generate-execute-tool-function-path", f"{HERE / 'multiturn_tools.py'}:tool",
]  # fmt: skip


def records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def assert_lands_on(reference: Path, save: Path, outcomes, leftovers: bool = False) -> None:
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(outcomes), table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.resumed, table
    diffs = compare_runs(reference, save)
    if leftovers:  # a tool journal's lines of a killed rollout, which the rerun ignores
        diffs = [d for d in diffs if not d.startswith(LEFTOVER_DIFF)]
    assert diffs == [], table


# row 45: the function under both schedules of train-async (`train` runs it in row 26)
USER_ROLLOUT_DRIVERS = {
    # slot N+1 made by the function in the generation thread while rollout N trains
    "one-step-off": [],
    # slots one weight version ahead; stale groups' prompts handed back to the function first
    "fully-async": [
        "--fully-async",
        "--max-weight-staleness", "1",
        "--update-weights-interval", "2",
        "--async-unused-samples-handler", "retry",
    ],
}  # fmt: skip


@pytest.mark.parametrize("schedule", sorted(USER_ROLLOUT_DRIVERS))
def test_a_user_rollout_function_ahead_killed_anywhere_lands_on_the_uninterrupted_run(
    schedule, builtin_model, tmp_path
):
    args = [
        *SMALL,
        "--num-rollout", "4",
        "--rollout-batch-size", "8",
        "--rollout-function-path", f"{HERE / 'user_rollout.py'}:rollout",
        *USER_ROLLOUT_DRIVERS[schedule],
    ]  # fmt: skip
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference, subcommand="train-async")
    state = json.loads(
        (
            checkpoint_path(reference, read_tracker(reference).iteration) / "trainer_state.json"
        ).read_text()
    )
    # the function drew past the 8 prompts a rollout: the data position is its own
    assert state["data"]["offset"] > 8 * 4, state["data"]
    chain = [
        Kill.at("async_generating", 2),  # inside the function's slot, in the thread
        Kill.at("commit_before_tracker", 2),
        Kill.at("after_generate", 2),  # a slot returned, the data moved, nothing saved
    ]
    save = tmp_path / "run"
    assert_lands_on(reference, save, run_with_kills(args, save, chain, subcommand="train-async"))


# row 49: partial rollout under both schedules of train-async (each slot a sampling round)
@pytest.mark.parametrize("schedule", sorted(USER_ROLLOUT_DRIVERS))
def test_partial_rollout_ahead_killed_anywhere_lands_on_the_uninterrupted_run(
    schedule, builtin_model, tmp_path
):
    args = [
        *SMALL,
        "--num-rollout", "5",
        "--partial-rollout",
        "--partial-rollout-round-tokens", "1",
        *USER_ROLLOUT_DRIVERS[schedule],
    ]  # fmt: skip
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference, subcommand="train-async")
    logged = [r for r in records(reference) if r["rollout_id"] >= 0]
    # answers were continued across slots with newer weights, and groups were in flight at saves
    assert sum(r["partial_rollout/continued_samples"] for r in logged) > 0, logged
    assert all(r["partial_rollout/groups_in_flight"] > 0 for r in logged[:-1]), logged
    chain = [
        Kill.at("async_generating", 3),  # inside a round, groups in flight
        Kill.at("commit_before_tracker", 2),
        Kill.at("after_generate", 2),
    ]
    save = tmp_path / "run"
    assert_lands_on(reference, save, run_with_kills(args, save, chain, subcommand="train-async"))


@pytest.fixture(scope="module")
def lora_server(builtin_model):
    (server,) = start_servers(
        builtin_model, 1, args=("--dtype", "float32", "--enable-lora", "--num-threads", "1")
    )
    yield server.url
    server.stop()


def test_fully_async_at_n2_with_lora_ppo_filter_and_tools_lands_on_the_uninterrupted_run(
    lora_server, tmp_path
):
    args = [
        *SMALL,
        *LORA,
        *PPO,
        *TOOLS,
        "--num-rollout", "4",
        "--precision", "fp32",
        "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
        "--fully-async",
        "--max-weight-staleness", "1",
        "--update-weights-interval", "2",
        "--async-unused-samples-handler", "retry",
        "--rollout-engine", "sglang",
        "--rollout-url", lora_server,
        "--rollout-timeout", "30",
    ]  # fmt: skip
    env = torchrun_env()
    reference = tmp_path / "reference"
    done = run_uninterrupted(args, reference, nproc=2, env=env, subcommand="train-async")
    assert "each update sends the adapter alone" in done.stdout, done.stdout
    logged = records(reference)
    # each feature of the row acted in the run the kills are compared with
    assert sum(r["rollout/tool_calls"] for r in logged) > 0
    assert logged[-1]["dynamic_filter/groups_dropped"] > 0
    assert all("value_loss" in r or "critic/value_loss" in r for r in logged), logged[0].keys()
    chain = [
        Kill.at("async_generating", 2, rank=0),  # a slot generating (tools running) ahead
        Kill.at("optimizer_step", 3, rank=1),
        Kill.at("commit_before_tracker", 2, rank=0),
    ]
    save = tmp_path / "run"
    outcomes = run_with_kills(
        args, save, chain, max_reruns=2, nproc=2, env=env, subcommand="train-async"
    )
    assert_lands_on(reference, save, outcomes, leftovers=True)


def test_partial_rollout_with_lora_and_a_critic_killed_anywhere_lands_on_the_uninterrupted_run(
    builtin_model, tmp_path
):
    args = [
        *SMALL,
        *LORA,
        *PPO,
        "--num-rollout", "4",
        "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
        "--over-sampling-batch-size", "6",
        "--partial-rollout",
        "--partial-rollout-round-tokens", "1",
        "--mask-offpolicy-in-partial-rollout",
    ]  # fmt: skip
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference)
    logged = records(reference)
    assert sum(r["partial_rollout/groups_resumed"] for r in logged) > 0
    assert sum(r["partial_rollout/offpolicy_masked"] for r in logged) > 0
    chain = [
        Kill.at("after_sampling_round", 3),  # aborted groups in the buffer, unsaved
        Kill.at("save_after_state", 2),
        Kill.at("optimizer_step", 5),
    ]
    save = tmp_path / "run"
    assert_lands_on(reference, save, run_with_kills(args, save, chain))
