"""A multi-turn run with tool calls (the built-in model and the scripted tool of
`multiturn_tools.py`: raises, hangs past --tool-timeout, answers) under the crash harness:
killed while a tool runs and after generating, rerun, and every checkpoint tensor and metrics
record equals the uninterrupted run. The uninterrupted run's saved samples replay to the same
tensors, and train-async at staleness 0 runs the same trajectories as train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_learned

from mileage.checkpoint.layout import checkpoint_path
from mileage.checkpoint.store import TRAINER_STATE
from mileage.rollout.buffer import STATE_KEY
from mileage.testing.compare import LEFTOVER_DIFF, TENSOR_DIFF, compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

pytestmark = pytest.mark.slow

TOOLS = Path(__file__).with_name("multiturn_tools.py")
ARGS = [
    "--num-rollout", "2",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--generate-execute-tool-function-path", f"{TOOLS}:tool",
    "--generate-tool-call-parser", "odd_digit",
    "--generate-max-turns", "3",
    "--tool-timeout", "1",
    # REINFORCE++ (token-level returns; composition row 15)
    "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages",
]  # fmt: skip
CHAIN = [
    Kill.at("tool_running", 2),  # rollout 0, while its tools run
    # rollout 0 again, whose first calls the journal answers now (they reach no tool_running),
    # or rollout 1: killed while a tool runs either way
    Kill.at("tool_running", 3),
]


def debug_args(save: Path) -> list[str]:
    return ["--save-debug-rollout-data", str(save.parent / "samples" / "{rollout_id}.json")]


@pytest.fixture(scope="module")
def reference(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("mt_reference") / "run"
    run_uninterrupted([*ARGS, *debug_args(save)], save)
    assert_learned(save, builtin_model)
    return save


def test_kills_while_tools_run_resume_to_the_uninterrupted_tensors(reference, tmp_path):
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    # the run under test calls tools, and some of them fail: the comparison covers all of it
    assert sum(r["rollout/tool_calls"] for r in records) > 0
    failed = sum(r["rollout/tool_errors"] + r["rollout/tool_timeouts"] for r in records)
    assert 0 < failed < sum(r["rollout/tool_calls"] for r in records)
    save = tmp_path / "run"
    outcomes = run_with_kills(ARGS, save, CHAIN)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    diffs = compare_runs(reference, save)
    assert [d for d in diffs if not d.startswith(LEFTOVER_DIFF)] == [], table
    # the journal keeps only what a resume could still need: nothing, once the last rollout's
    # checkpoint has committed
    assert list((save / "tool_journal").iterdir()) == []


def test_saved_multi_turn_samples_replay_to_the_same_tensors(reference, tmp_path):
    saved = [
        s
        for rollout_id in (0, 1)
        for s in json.loads((reference.parent / "samples" / f"{rollout_id}.json").read_text())[
            "samples"
        ]
    ]
    assert any(0 in s["loss_mask"] for s in saved)  # tool tokens are in the files, masked
    save = tmp_path / "replay"
    template = str(reference.parent / "samples" / "{rollout_id}.json")
    run_uninterrupted([*ARGS, "--load-debug-rollout-data", template], save)
    assert [d for d in compare_runs(reference, save) if d.startswith(TENSOR_DIFF)] == []


def test_train_async_at_staleness_0_runs_the_same_trajectories(reference, tmp_path):
    save = tmp_path / "async"
    done = launch(
        [*ARGS, "--fully-async", "--max-weight-staleness", "0", *debug_args(save)],
        save,
        subcommand="train-async",
    )
    assert done.returncode == 0, done.tail()
    for rollout_id in (0, 1):
        mine = json.loads((save.parent / "samples" / f"{rollout_id}.json").read_text())
        theirs = json.loads((reference.parent / "samples" / f"{rollout_id}.json").read_text())
        assert mine["samples"] == theirs["samples"]
    assert [d for d in compare_runs(reference, save) if d.startswith(TENSOR_DIFF)] == []


def test_partial_rollout_through_mileage_serve_kills_while_tools_run_resume_exactly(
    builtin_model, tmp_path
):
    """The tool loop with the engine behind HTTP (`mileage serve`, SGLang's API: token ids in
    and out, a seed per call) and --partial-rollout: each sampling round gives a trajectory 2
    model tokens, so turns are cut open and continued in later rounds and rollouts with newer
    weights. Killed while a tool runs, the rerun ends on the uninterrupted run's tensors. Then
    with a tool that answers a random letter on every call: killed after rollout 1 generated
    (its rounds continued rollout 0's trajectories), the rerun generates every round of
    rollout 1 again with the journal's answers, to the same samples the killed process had."""
    from mileage.testing.servers import start_servers

    # fp32 on both sides: the log-prob check below is then to the summation order alone
    (server,) = start_servers(builtin_model, 1, args=("--dtype", "float32"))
    try:
        args = [*ARGS, "--rollout-engine", "sglang", "--rollout-url", server.url,
                "--rollout-timeout", "30", "--precision", "fp32",
                "--partial-rollout", "--partial-rollout-round-tokens", "2",
                "--mask-offpolicy-in-partial-rollout"]  # fmt: skip
        reference = tmp_path / "reference"
        run_uninterrupted(args, reference)
        records = read_records(reference)
        assert sum(r["rollout/tool_calls"] for r in records) > 0
        # partial rollout did bind: trajectories were aborted at rollout 0's batch and continued
        assert records[0]["partial_rollout/groups_aborted"] > 0
        assert records[1]["partial_rollout/groups_resumed"] > 0
        assert records[1]["partial_rollout/offpolicy_tokens"] > 0
        # the server's log-probs are the trainer's: the tool tokens between turns did not shift
        # what the engine saw from what the trainer scores
        assert all(r["logprob_abs_diff"] < 1e-4 for r in records), [
            r["logprob_abs_diff"] for r in records
        ]
        save = tmp_path / "run"
        outcomes = run_with_kills(args, save, CHAIN[:1])
        table = outcome_table(outcomes)
        assert [o.status for o in outcomes] == ["killed"], table
        assert not outcomes[0].problems, table
        diffs = compare_runs(reference, save)
        assert [d for d in diffs if not d.startswith(LEFTOVER_DIFF)] == [], table

        rounds = tmp_path / "rounds"
        tool = args.index(f"{TOOLS}:tool")
        random = [*args[:tool], f"{TOOLS}:tool_nondet", *args[tool + 1 :],
                  "--save-debug-rollout-data", str(rounds / "{slot}.json")]  # fmt: skip
        save = tmp_path / "random"
        killed = launch(random, save, Kill.at("after_generate", 2))
        assert killed.died_by_kill, killed.tail()
        state = json.loads((checkpoint_path(save, 0) / TRAINER_STATE).read_text())
        first_slot = state[STATE_KEY]["next_slot"]  # rollout 1's first round
        written = {p.name: p.read_text() for p in rounds.iterdir()}
        rerun = launch(random, save)
        assert rerun.returncode == 0, rerun.tail()
        again = {p.name: p.read_text() for p in rounds.iterdir()}
        ours = sorted(n for n in written if int(n.split(".")[0]) >= first_slot)
        assert ours and all(again[n] == written[n] for n in ours)
        letters = [c["output"] for n in ours for s in json.loads(written[n])["samples"]
                   for c in s["tool_calls"] if c["status"] == "ok"]  # fmt: skip
        assert letters and all(out[-1].isalpha() for out in letters)
    finally:
        server.stop()


def read_records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
