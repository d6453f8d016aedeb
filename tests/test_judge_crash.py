"""LLM-judge rewards under kill -9 (composition row 44): a run scored by a judge server, with
dynamic sampling's filter on the judge's scores, killed mid-round, after a rollout's scoring and
mid-save, lands on the uninterrupted run's tensors; a judge that samples (a random score on every
call) is read back from the journal after a kill; a judge server that dies mid-rollout, one that
answers garbage and one that is not there each stop the run in one line with nothing lost.
The judge is tests/judge_server.py, an OpenAI-compatible stand-in whose replies are scripted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from judge_server import StandIn

from mileage.rollout.dynamic import MILES_NONZERO_STD
from mileage.testing.compare import LEFTOVER_DIFF, compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

pytestmark = pytest.mark.slow

BASE = [
    "--num-rollout", "3",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--rm-type", "llm_judge",
    "--rm-retries", "1",
]  # fmt: skip
# dynamic sampling keeps groups whose judge scores differ: the judge decides what trains; on a
# LoRA adapter, with GSPO's sequence-level ratio
FILTERED = [
    *BASE,
    "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
    "--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear",
    "--advantage-estimator", "gspo",
]  # fmt: skip
CHAIN = [
    Kill.at("after_sampling_round", 2),  # a round scored and journaled, the rollout not trained
    Kill.at("after_generate", 2),  # rollout 1 scored, not trained
    Kill.at("commit_before_tracker"),  # a checkpoint renamed, its tracker not yet moved
]


def records(save: Path) -> list[dict]:
    path = save / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def judged(url: str, args: list[str] = FILTERED) -> list[str]:
    return [*args, "--rm-url", url]


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("judges")
    started = {mode: StandIn(tmp, mode) for mode in ("graded", "random", "garbage")}
    yield {mode: judge.url for mode, judge in started.items()}
    for judge in started.values():
        judge.stop()


@pytest.fixture(scope="module")
def reference(builtin_model, judges, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("judge_reference") / "run"
    done = run_uninterrupted(judged(judges["graded"]), save)
    # the plan says what grades the run before it trains
    assert f"  reward: the LLM judge {judges['graded']} (model stand-in-judge" in done.stdout
    logged = records(save)
    assert len(logged) == 3
    # the judge's half marks are among the rewards (rewards are 0, 0.5 or 1, and `accuracy` is
    # the share of whole marks, so the mean is above it exactly when some answer got a half),
    # and groups it scored alike were dropped
    assert any(r["reward_mean"] > r["accuracy"] for r in logged), logged
    assert sum(r["dynamic_filter/groups_dropped"] for r in logged) > 0
    return save


def test_a_judged_run_killed_anywhere_lands_on_the_uninterrupted_tensors(
    judges, reference, tmp_path
):
    save = tmp_path / "run"
    outcomes = run_with_kills(judged(judges["graded"]), save, CHAIN)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    diffs = compare_runs(reference, save)
    assert [d for d in diffs if not d.startswith(LEFTOVER_DIFF)] == [], table


def test_a_sampling_judge_s_scores_are_replayed_from_the_journal_after_a_kill(
    builtin_model, judges, tmp_path
):
    samples = tmp_path / "samples"
    args = [
        *judged(judges["random"], BASE),
        "--save-debug-rollout-data",
        f"{samples}/{{rollout_id}}.json",
    ]
    save = tmp_path / "run"
    killed = launch(args, save, Kill.at("after_generate", 2))  # rollout 1 scored, unsaved
    assert killed.died_by_kill, killed.tail()
    first = json.loads((samples / "1.json").read_text())
    assert len({s["reward"] for s in first["samples"]}) > 1  # the random judge's scores
    journal = (save / "tool_journal" / "slot_1.jsonl").read_text()
    assert journal.count('"key": "reward/') == 16
    rerun = launch(args, save)
    assert rerun.returncode == 0, rerun.tail()
    assert rerun.plan is not None and rerun.plan[0] == 1
    # rollout 1 generated again and scored from the journal: the killed process's rewards
    assert json.loads((samples / "1.json").read_text()) == first
    assert len(records(save)) == 3


def test_a_judge_that_dies_mid_rollout_stops_the_run_and_a_rerun_continues_exactly(
    judges, reference, tmp_path
):
    # 16 requests per sampling round: it dies during rollout 1's first round
    first_rollout = records(reference)[0]["dynamic_filter/rounds"] * 16
    dying = StandIn(tmp_path, "graded", "--die-after", str(first_rollout + 4))
    save = tmp_path / "run"
    try:
        stopped = launch(judged(dying.url), save)
    finally:
        dying.stop()
    assert stopped.returncode == 2, stopped.tail()
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mileage: error: the LLM judge {dying.url}/chat/completions "), last
    assert "the last checkpoint is unchanged" in last
    assert "Traceback" not in stopped.stderr
    saved = records(save)
    assert len(saved) == 1  # rollout 0, saved before the judge died
    # the same command against a judge that is up again (here: another port) continues
    rerun = launch(judged(judges["graded"]), save)
    assert rerun.returncode == 0, rerun.tail()
    assert records(save)[: len(saved)] == saved
    diffs = compare_runs(reference, save)
    assert [d for d in diffs if not d.startswith(LEFTOVER_DIFF)] == []


def test_a_garbage_or_absent_judge_is_one_line_and_exit_2(builtin_model, judges, tmp_path):
    garbage = launch(judged(judges["garbage"]), tmp_path / "garbage")
    assert garbage.returncode == 2, garbage.tail()
    last = garbage.stderr.strip().splitlines()[-1]
    assert "replied 'I cannot grade this.', which holds no score" in last, last
    assert "Traceback" not in garbage.stderr and records(tmp_path / "garbage") == []
    absent = launch(judged("http://127.0.0.1:9/v1"), tmp_path / "absent")
    assert absent.returncode == 2, absent.tail()
    last = absent.stderr.strip().splitlines()[-1]
    assert last.startswith("mileage: error: the LLM judge http://127.0.0.1:9/v1 unreachable"), last
    assert absent.plan is None  # refused before the run was planned
