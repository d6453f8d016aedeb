"""--partial-rollout: the round logic and continuation on a scripted engine (what is aborted
where, prompt + partial answer as the next input, per-token weight versions carried over), the
off-policy mask against a hand-built reference, the buffer's JSON round trip, bad flags, and
end to end on the built-in model with dynamic sampling: kills between sampling rounds, while the
buffer is written and at commit points resume to the uninterrupted run's tensors (in one process,
and killed while saving under torchrun at N=2), and every prompt of every epoch is drawn once and
is trained, dropped or left in the saved buffer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.store import TRAINER_STATE
from mileage.rollout.buffer import STATE_KEY, RolloutBuffer
from mileage.rollout.data import Prompt, PromptSource
from mileage.rollout.dynamic import MILES_NONZERO_STD, DynamicSamplingConfig
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.partial import RoundGenerator, offpolicy_tokens, sample_partial
from mileage.rollout.rollout import PromptEncoder, Sample
from mileage.rollout.tasks import builtin_task
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill
from mileage.training.batch import mask_offpolicy, pack_samples

EOS = 0
MAX_LEN = 5
# the whole answer each prompt's samples would write (prompt index -> tokens; EOS ends it)
ANSWERS = {
    0: [11, EOS],  # done in round 1
    1: [21, 22, 23, 24, 25, 26, 27],  # never ends: stops at MAX_LEN in round 3
    2: [31, 32, EOS],  # done in round 2
    3: [EOS],  # done in its first round
    4: [41, 42, 43, EOS],
    5: [51, 52, 53, 54, EOS],
}


class CharTokenizer:
    """Prompt text "k" encodes to [100 + k]; decoding joins the ids."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [100 + int(text)]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == EOS))


class ScriptedEngine:
    """Continues each input (prompt id + partial answer) along its prompt's scripted answer;
    every token's log-prob names the weight version that wrote it."""

    in_process = True

    def __init__(self) -> None:
        self.weight_version = 0
        self.calls: list[tuple[list[list[int]], int, int, str]] = []

    def generate(self, prompts, params, seed=None, group_size=1) -> list[Completion]:
        call = ([list(p) for p in prompts], params.max_new_tokens, seed.rollout_id, seed.purpose)
        self.calls.append(call)
        out = []
        for ids in prompts:
            answer, done = ANSWERS[ids[0] - 100], ids[1:]
            assert answer[: len(done)] == done, "a continuation must start from its own prefix"
            new = answer[len(done) : len(done) + params.max_new_tokens]
            logprob = -(self.weight_version + 1) / 4
            out.append(
                Completion(list(ids), new, [logprob] * len(new), EOS in new, self.weight_version)
            )
        return out


def reward(prompt: str, response: str, label: str) -> float:
    return float(len(response))


def run_rollout(engine, buffer, source, rollout_id: int, keep=None):
    generator = RoundGenerator(
        engine,
        PromptEncoder(CharTokenizer(), chat_template=False),
        SamplingParams(MAX_LEN),
        round_tokens=2,
        n_samples=2,
        reward_fn=reward,
        seed=7,
    )
    cfg = DynamicSamplingConfig(None, over_sampling_batch_size=3, partial_rollout=True)
    return sample_partial(
        buffer,
        source.next_batch,
        lambda carried, prompts, slot: generator(carried, prompts, slot, rollout_id),
        keep,
        None,
        None,
        cfg,
        2,
        generator.group_done,
        rollout_id,
    )


def test_unfinished_groups_are_aborted_at_the_batch_and_continue_with_newer_weights():
    source = PromptSource([Prompt(i, str(i), "") for i in range(6)], shuffle=False, seed=0)
    engine, buffer = ScriptedEngine(), RolloutBuffer()
    out = run_rollout(engine, buffer, source, 0)
    # round 1 (slot 0) draws 0,1,2: 0 finishes; round 2 continues 1,2 and draws 3: 2 fills the
    # batch, 3 finished after it (waits), 1 is still in flight: aborted
    assert [g.prompt.index for g in out.groups] == [0, 2]
    assert [g.prompt.index for g in buffer.groups] == [3]
    assert [g.prompt.index for g in buffer.partial] == [1]
    assert [p.index for p in out.drawn] == [0, 1, 2, 3]
    assert source.state_dict()["offset"] == 4
    assert [c[2] for c in engine.calls] == [0, 1] and buffer.next_slot == 2  # seeded by slot
    assert engine.calls[1][0] == [[101, 21, 22]] * 2 + [[102, 31, 32]] * 2 + [[103]] * 2
    assert out.stats["partial_rollout/groups_aborted"] == 1
    assert out.stats["dynamic_filter/groups_kept"] == 3
    aborted = buffer.partial[0].samples[0]
    assert aborted.response_ids == [21, 22, 23, 24] and aborted.weight_versions == [0] * 4
    assert not aborted.finished and aborted.response == ""

    # the checkpoint holds the in-flight group with its tokens and versions, bit for bit
    again = RolloutBuffer()
    again.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert again.state_dict() == buffer.state_dict()
    buffer = again

    engine.weight_version = 3  # the trainer stepped: the next rollout continues with new weights
    out = run_rollout(engine, buffer, source, 1)
    # the finished leftover first; round 3 continues 1 (its last token: the length limit)
    assert [g.prompt.index for g in out.groups] == [3, 1]
    assert out.stats["partial_rollout/groups_resumed"] == 1
    # the round's new prompts take the full budget; the answer one token short of MAX_LEN is
    # asked for one token only, in a call of its own seeded apart
    assert engine.calls[2] == ([[104]] * 2 + [[105]] * 2, 2, 2, "rollout")
    assert engine.calls[3] == ([[101, 21, 22, 23, 24]] * 2, 1, 2, "rollout/partial-tail-1")
    assert [c[3] for c in engine.calls[:2]] == ["rollout", "rollout"]
    resumed = out.groups[1].samples[0]
    assert resumed.response_ids == [21, 22, 23, 24, 25]
    assert resumed.weight_versions == [0, 0, 0, 0, 3]
    assert resumed.logprobs == [-0.25] * 4 + [-1.0]
    assert not resumed.finished and resumed.weight_version == 3
    assert resumed.response == "21 22 23 24 25" and resumed.reward == 14.0
    assert [g.prompt.index for g in buffer.partial] == [4, 5]
    assert offpolicy_tokens(out.groups[1].samples, 3) == 8  # 4 old tokens in each of 2 samples


def test_round_cap_counts_rounds_spent_continuing():
    source = PromptSource([Prompt(i, "1", "") for i in range(6)], shuffle=False, seed=0)
    cfg = DynamicSamplingConfig(None, 3, dynamic_sampling_max_rounds=2, partial_rollout=True)
    generator = RoundGenerator(
        ScriptedEngine(), PromptEncoder(CharTokenizer(), False), SamplingParams(9), 1, 1, reward, 0
    )
    from mileage.errors import UserError

    with pytest.raises(UserError, match="kept 0 of 2 groups after 2 rounds"):
        sample_partial(
            RolloutBuffer(),
            source.next_batch,
            lambda c, p, s: generator(c, p, s, 0),
            None,
            None,
            None,
            cfg,
            2,
            generator.group_done,
            0,
        )


def sample(prompt_len: int, versions: list[int]) -> Sample:
    n = len(versions)
    return Sample(
        Prompt(0, "", ""), [5] * prompt_len, [6] * n, [-0.5] * n, "", 1.0, True, 0, versions
    )


def test_offpolicy_mask_keeps_only_the_current_versions_tokens():
    samples = [sample(2, [1, 1, 2]), sample(3, [2, 2]), sample(1, [0, 1, 2, 2])]
    batch = pack_samples(samples, pad_id=0)
    assert mask_offpolicy(batch, samples, 2) == 4
    # target column j predicts token j+1: row 0's answer starts at column 1, row 1's at 2 and
    # row 2's at 0; only the version-2 tokens stay in the loss
    expected = torch.tensor(
        [
            [0.0, 0.0, 0.0, 1.0],
            [0.0, 0.0, 1.0, 1.0],
            [0.0, 0.0, 1.0, 1.0],
        ]
    )
    assert torch.equal(batch.loss_mask, expected)
    assert mask_offpolicy(batch, [sample(2, [2, 2, 2])] * 3, 2) == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mask-offpolicy-in-partial-rollout"], "needs --partial-rollout"),
        (["--partial-rollout-round-tokens", "2"], "needs --partial-rollout"),
        (["--partial-rollout", "--partial-rollout-round-tokens", "0"], "must be positive"),
        (
            ["--partial-rollout", "--load-debug-rollout-data", "x/{rollout_id}.json"],
            "cannot replay --load-debug-rollout-data",
        ),
        (
            ["--partial-rollout", "--custom-generate-function-path", "gen.py:generate"],
            "lives in your function's own frames, which no checkpoint can hold",
        ),
        (
            ["--partial-rollout", "--rollout-function-path", "rollout.py:rollout"],
            "with --rollout-function-path a trajectory's progress lives in your function's",
        ),
    ],
)
def test_bad_partial_rollout_flags_are_one_line_and_exit_2(cli, tmp_path, extra, message):
    done = cli("train", "--save", tmp_path / "s", *extra)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- end to end

PROMPTS = 16


def partial_args(prompt_file: Path, *extra: object) -> list[str]:
    return [
        "--prompt-data", prompt_file,
        "--rollout-shuffle",
        "--num-rollout", "5",
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4",
        "--global-batch-size", "8",
        "--lr", "1e-4",
        "--eval-interval", "0",
        "--num-threads", "1",
        "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
        "--over-sampling-batch-size", "6",
        "--partial-rollout",
        "--partial-rollout-round-tokens", "1",
        "--mask-offpolicy-in-partial-rollout",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def partial_reference(builtin_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pr_ref")
    prompt_file = root / "prompts.jsonl"
    records = builtin_task("addition")[0][:PROMPTS]
    prompt_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    rounds = root / "rounds" / "{rollout_id}.json"
    save = root / "run"
    run_uninterrupted(partial_args(prompt_file, "--save-debug-rollout-data", rounds), save)
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return prompt_file, save, rounds, [r for r in map(json.loads, lines) if r["rollout_id"] >= 0]


@pytest.mark.slow
def test_partial_rollout_trains_continued_answers_and_accounts_for_every_prompt(
    partial_reference, builtin_model
):
    from conftest import assert_learned

    _, save, rounds, records = partial_reference
    assert_learned(save, builtin_model)
    # partial rollout did bind: groups were aborted, resumed, and trained with masked old tokens
    assert sum(r["partial_rollout/groups_aborted"] for r in records) > 0
    assert sum(r["partial_rollout/groups_resumed"] for r in records) > 0
    assert sum(r["partial_rollout/offpolicy_tokens"] for r in records) > 0
    for r in records:
        assert r["partial_rollout/offpolicy_masked"] == r["partial_rollout/offpolicy_tokens"]
    last = checkpoint_path(save, read_tracker(save).iteration)
    state = json.loads((last / TRAINER_STATE).read_text())
    buffer = state[STATE_KEY]
    mixed = [
        s
        for slot in range(buffer["next_slot"])
        for s in json.loads(Path(str(rounds).format(rollout_id=slot)).read_text())["samples"]
        if len(set(s["weight_versions"])) > 1
    ]
    assert mixed, "no answer was continued with newer weights"
    assert all(s["weight_versions"] == sorted(s["weight_versions"]) for s in mixed)

    # the data position: the prompts drawn, rollout after rollout, are the epochs' orders
    drawn = [i for r in records for i in r["drawn_prompt_indices"]]
    source = PromptSource([Prompt(i, "", "") for i in range(PROMPTS)], shuffle=True, seed=1234)
    assert drawn == [p.index for p in source.next_batch(len(drawn))]
    assert len(drawn) > PROMPTS
    assert state["data"]["epoch"] * PROMPTS + state["data"]["offset"] == len(drawn)
    # every drawn group is trained once, dropped, or in the saved buffer (finished or in flight)
    trained = [
        (s, i) for r in records for s, i in zip(r["group_slots"], r["prompt_indices"], strict=True)
    ]
    assert len(set(trained)) == len(trained)
    dropped = sum(r["dynamic_filter/groups_dropped"] for r in records)
    assert dropped > 0
    saved = [(g["slot"], g["samples"][0]["prompt"]["index"]) for k in ("groups", "partial")
             for g in buffer.get(k, [])]  # fmt: skip
    assert not set(saved) & set(trained)
    assert len(trained) + dropped + len(saved) == len(drawn)


PARTIAL_CHAIN = [
    Kill.at("after_sampling_round", 2),
    Kill.at("save_after_optimizer"),  # before the trainer state (with the buffer) is written
    Kill.at("save_after_state"),
    Kill.at("after_sampling_round", 4),
    Kill.at("commit_before_rename"),
    Kill.at("commit_after_tracker"),
]


@pytest.mark.slow
def test_kills_between_rounds_and_at_commits_resume_to_the_uninterrupted_partial_run(
    partial_reference, tmp_path
):
    prompt_file, reference, _, _ = partial_reference
    save = tmp_path / "run"
    outcomes = run_with_kills(partial_args(prompt_file), save, PARTIAL_CHAIN)
    table = outcome_table(outcomes)
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    assert sum(o.status == "killed" for o in outcomes) >= 5, table
    # the same tensors and metrics: the same prompts drawn, aborted, continued and trained
    assert compare_runs(reference, save) == [], table


@pytest.mark.slow
def test_under_torchrun_kills_resume_to_the_uninterrupted_n2_run(
    partial_reference, builtin_model, tmp_path
):
    """Every rank samples its share of each round and gathers all of it, so every rank judges the
    same groups and holds the same buffer; rank 0 saves it. Rank 1 killed between rounds, then
    rank 0 killed after writing the second checkpoint's buffer: the rerun restores the first checkpoint's buffer on both ranks
    and ends on the uninterrupted N=2 run (the one-process chain above kills between rounds)."""
    from conftest import REPO, assert_learned

    prompt_file = partial_reference[0]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = partial_args(prompt_file, "--num-rollout", "3")
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference, nproc=2, env=env, timeout=300)
    assert_learned(reference, builtin_model)
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("partial_rollout/groups_aborted", 0) for r in records) > 0
    kills = [
        Kill.at("after_sampling_round", 4, rank=1),  # between rounds, groups aborted, unsaved
        Kill.at("save_after_state", 2, rank=0),
    ]
    save = tmp_path / "run"
    outcomes = run_with_kills(args, save, kills, max_reruns=2, nproc=2, env=env, timeout=300)
    table = outcome_table(outcomes)
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert compare_runs(reference, save) == [], table
