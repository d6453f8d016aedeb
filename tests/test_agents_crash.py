"""The example agent (`examples/openai_agent.py`, a plain `openai` client loop) trains the built-in
tool task end to end and lands on exactly the built-in tool loop's tensors (it asks for the same
conversations, so it gets the same tokens); in the configuration agentic RL runs (train-async,
dynamic sampling's filter, LoRA) it resumes bit for bit when killed mid-request, between turns
and mid-save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mileage.rollout.dynamic import MILES_NONZERO_STD
from mileage.testing.compare import LEFTOVER_DIFF, TENSOR_DIFF, compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

pytestmark = pytest.mark.slow

AGENT = Path(__file__).parents[1] / "examples" / "openai_agent.py"
BASE = [
    "--builtin-task", "addition-tool",
    "--num-rollout", "3",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
]  # fmt: skip
AGENT_ARGS = [*BASE, "--agent-function-path", f"{AGENT}:agent"]
AGENTIC = [
    *AGENT_ARGS,
    "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
    "--lora-rank", "4",
    "--lora-alpha", "8",
    "--target-modules", "all-linear",
]  # fmt: skip
# a slot makes 16 first requests, then one more per sample that called the calculator
CHAIN = [
    Kill.at("agent_answered", 45),  # answers journaled, not yet sent
    Kill.at("agent_request", 30),  # a request read, its answers not yet generated
    Kill.at("commit_before_tracker"),  # a checkpoint renamed, its tracker not yet moved
]


@pytest.fixture(scope="module")
def tool_model(mileage_home):
    from mileage.rollout.builtin_model import ensure_builtin_model

    with torch.random.fork_rng():
        return ensure_builtin_model("addition-tool")


def records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_the_agent_trains_exactly_as_the_built_in_tool_loop(tool_model, tmp_path):
    reference = tmp_path / "agent"
    run_uninterrupted(AGENT_ARGS, reference)
    logged = records(reference)
    assert all(r["rollout/agent_failures"] == 0 and r["rollout/agent_splits"] == 0 for r in logged)
    assert sum(r["rollout/tool_calls"] for r in logged) > 0

    loop = tmp_path / "tool_loop"
    run_uninterrupted(BASE, loop)  # the task's own tool loop
    tensors = [d for d in compare_runs(reference, loop) if d.startswith(TENSOR_DIFF)]
    assert tensors == []
    for a, b in zip(logged, records(loop), strict=True):
        assert (
            a["reward_mean"] == b["reward_mean"]
            and a["rollout/tool_calls"] == b["rollout/tool_calls"]
        )


def test_agentic_rl_with_the_agent_resumes_exactly(tool_model, tmp_path):
    reference = tmp_path / "reference"
    run_uninterrupted(AGENTIC, reference, subcommand="train-async")
    logged = records(reference)
    assert sum(r["rollout/tool_calls"] for r in logged) > 0
    assert all(r["staleness_max"] <= 1 for r in logged)
    save = tmp_path / "killed"
    outcomes = run_with_kills(AGENTIC, save, CHAIN, subcommand="train-async")
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    diffs = compare_runs(reference, save)
    assert [d for d in diffs if not d.startswith(LEFTOVER_DIFF)] == [], table
