"""Features composed under kill -9: the configuration users run for agentic RL, through the one
driver, and the tool journal proven with a tool whose answer is random on every call.

- train-async (one-step-off) + dynamic sampling's filter + the overlong penalty + truncation
  masking + multi-turn tools + LoRA + chunked log-probs: killed while a slot generates ahead and between a save's
  rename and its tracker, rerun, and every tensor and metrics record equals the uninterrupted
  run's.
- A tool answering with `os.urandom`: a rollout killed after it generated is generated again by
  the rerun with the journaled answers, so it trains on exactly the samples the killed process
  had (a rerun without the journal would get other answers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mileage.rollout.dynamic import MILES_NONZERO_STD
from mileage.testing.compare import LEFTOVER_DIFF, compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill
from mileage.testing.servers import start_servers

pytestmark = pytest.mark.slow

TOOLS = Path(__file__).with_name("multiturn_tools.py")
TOOL_ARGS = [
    "--generate-tool-call-parser", "odd_digit",
    "--generate-max-turns", "3",
    "--tool-timeout", "1",
]  # fmt: skip
BASE = [
    "--num-rollout", "3",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
]  # fmt: skip
AGENTIC = [
    *BASE,
    *TOOL_ARGS,
    "--generate-execute-tool-function-path", f"{TOOLS}:tool",
    "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
    "--overlong-buffer-len", "2",
    "--overlong-penalty-factor", "0.5",
    "--mask-truncated-completions",
    "--lora-rank", "4",
    "--lora-alpha", "8",
    "--target-modules", "all-linear",
    # the LM head and log-probs a few tokens at a time (the built-in model's default is one
    # chunk per forward), with the backward recomputing each chunk
    "--log-probs-chunk-size", "8",
    "--gradient-checkpointing",  # each layer recomputed in the backward, LoRA's layers too
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "40",  # packed micro-batches
]  # fmt: skip
AGENTIC_CHAIN = [
    Kill.at("async_generating", 2),  # slot 1 generating while rollout 0 trains
    Kill.at("commit_before_tracker"),  # a checkpoint renamed, its tracker not yet moved
]


def records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_async_dynamic_sampling_shaping_tools_and_lora_resume_exactly(
    builtin_model, tiny_hf, tmp_path
):
    # and distilled from a served teacher (the tiny model behind `mileage serve`), whose scores
    # are journaled beside the tools' answers
    (teacher,) = start_servers(tiny_hf, 1, args=("--dtype", "float32", "--num-threads", "1"))
    try:
        agentic_with_teacher(teacher.url, tmp_path)
    finally:
        teacher.stop()


def agentic_with_teacher(teacher_url: str, tmp_path: Path) -> None:
    args = [*AGENTIC, "--use-opd", "--opd-type", "sglang", "--opd-teacher-url", teacher_url]
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference, subcommand="train-async")
    logged = records(reference)
    # every feature of the row did something the comparison below covers
    assert sum(r["rollout/tool_calls"] for r in logged) > 0
    assert all("truncated_masked" in r for r in logged)
    # the penalty shaped the trained rewards of the groups generated ahead
    assert any(r["overlong_reward_mean"] < r["reward_mean"] - 1e-6 for r in logged)
    assert logged[-1]["dynamic_filter/groups_dropped"] > 0
    assert all(r["staleness_max"] <= 1 for r in logged)
    assert all(abs(r["opd_reverse_kl"]) > 1e-4 for r in logged)

    save = tmp_path / "run"
    outcomes = run_with_kills(args, save, AGENTIC_CHAIN, subcommand="train-async")
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(AGENTIC_CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    diffs = compare_runs(reference, save)
    assert [d for d in diffs if not d.startswith(LEFTOVER_DIFF)] == [], table


def test_a_random_tool_s_answers_are_replayed_from_the_journal_after_a_kill(
    builtin_model, tmp_path
):
    samples = tmp_path / "samples"
    args = [
        *BASE,
        *TOOL_ARGS,
        "--generate-execute-tool-function-path", f"{TOOLS}:tool_nondet",
        "--save-debug-rollout-data", str(samples / "{rollout_id}.json"),
    ]  # fmt: skip
    save = tmp_path / "run"
    killed = launch(args, save, Kill.at("after_generate", 2))  # rollout 1, generated, unsaved
    assert killed.died_by_kill, killed.tail()
    first = json.loads((samples / "1.json").read_text())  # the killed process's rollout 1
    # the journal is part of what the resume restores: a changed byte in a copy of it stops the
    # run in one line before it trains (the copy's metrics are not extended)
    damaged = tmp_path / "damaged"
    shutil.copytree(save, damaged)
    journal = damaged / "tool_journal" / "slot_1.jsonl"
    journal.write_text(journal.read_text().replace('"ok"', '"ko"', 1))
    refused = launch([*args[:-2]], damaged)
    assert refused.returncode == 2, refused.tail()
    assert refused.stderr.strip().splitlines()[-1].startswith("mileage: error: the tool journal ")
    assert "is damaged at line 1 " in refused.stderr
    assert records(damaged) == records(save)
    rerun = launch(args, save)
    assert rerun.returncode == 0, rerun.tail()
    assert rerun.plan is not None and rerun.plan[0] == 1
    # rollout 1 generated again, with the same tool answers (random letters) from the journal
    assert json.loads((samples / "1.json").read_text()) == first
    assert records(save)[1]["rollout/tool_calls"] > 0
