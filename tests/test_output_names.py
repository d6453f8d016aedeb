"""What mileage prints means what it says: a mean reward is called reward and the share of
answers with reward >= 1 "solved"; train-async's tok/s is the generator's own rate, with the
samples' staleness beside it; the resume line and the plan's defaults line read without the
source. Formatters are called on fake records: no model, no training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mileage.cli.main import build_parser
from mileage.progress import restored_line, summary_line
from mileage.rollout.buffer import Group
from mileage.rollout.data import EvalSet
from mileage.rollout.evaluation import EvalConfig, evaluate, summary
from mileage.rollout.prompts import Prompt
from mileage.rollout.rollout import RolloutConfig, Sample
from mileage.run_config import RunConfig
from mileage.sources.ahead import generation_rate

ROLLOUT = {
    "rollout_id": 7,
    "reward_mean": 1.0,
    "accuracy": 0.5,
    "lr": 1e-4,
    "tokens_per_s": 812.4,
    "step_time": 2.5,
}


class HalfRightEngine:
    """Every answer one token; the scorer below decides what each is worth."""

    def generate(self, prompts, params, seed, group_size):
        done = {"logprobs": [0.0], "finished": True, "weight_version": 0}
        return [SimpleNamespace(prompt_ids=p, response_ids=[1], **done) for p in prompts]


def test_a_weighted_rubric_evaluates_as_reward_1_and_half_solved():
    """A rubric whose weights give a right answer 2.0: half the answers right is a mean reward
    of 1.0, which the line once called "accuracy 1.000"."""

    def encode(text):
        return [0]

    encode.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "x")

    def score(samples, n):
        for i, s in enumerate(samples):
            s.reward = 2.0 if i % 2 == 0 else 0.0

    eval_set = EvalSet("rubric", [Prompt(0, "q0", "a"), Prompt(1, "q1", "a")])
    cfg = EvalConfig(n_samples_per_eval_prompt=2)
    metrics = evaluate(
        HalfRightEngine(), encode, [eval_set], cfg, RolloutConfig(), None, 1, 0, score
    )
    assert metrics["eval_reward"] == metrics["eval_accuracy"] == 1.0  # the old key kept
    assert metrics["eval/rubric/pass@1"] == 0.5
    assert summary(metrics) == "reward 1.000 solved 0.500 (pass@2 1.000)"
    line = summary_line({**ROLLOUT, **metrics})
    assert line.endswith(" | eval reward 1.000 solved 0.500 (pass@2 1.000)"), line
    assert "acc" not in line


def test_the_rollout_line_names_the_mean_reward_and_the_share_solved():
    line = summary_line(ROLLOUT)
    assert line == "rollout 7 | reward 1.000 | solved 0.500 | lr 1.00e-04 | 812 tok/s | 2.50s"


def test_several_eval_datasets_each_say_reward_and_solved():
    record = {**ROLLOUT, "eval/a": 0.75, "eval/a/pass@1": 0.25, "eval/b": 0.0}
    record |= {"eval/b/pass@1": 0.0, "eval/b/truncated_ratio": 1.0}
    assert summary_line(record).endswith(
        " | eval a reward 0.750 solved 0.250; b reward 0.000 solved 0.000"
    )


def test_the_async_line_shows_the_generators_rate_and_the_staleness():
    record = {**ROLLOUT, "staleness_mean": 0.5, "staleness_max": 1, "stale_groups": 0}
    assert " | 812 tok/s | staleness 0.5 (max 1) | 2.50s" in summary_line(record)
    # every group restored from a checkpoint: nobody timed their generation, so no rate
    assert "tok/s" not in summary_line({**record, "tokens_per_s": None})


def group(slot: int, tokens: int) -> Group:
    sample = Sample(Prompt(slot, "p", "1"), [1], [5] * tokens, [0.0] * tokens, "", 0.0, True, 0)
    return Group(slot, 0, [sample])


def test_async_throughput_is_tokens_over_the_generators_busy_time_not_the_wait():
    # slot 3: 100 tokens in 2 s, slot 4: 300 tokens in 1 s; the trainer waited ~0 s for them
    times = {3: (2.0, 100), 4: (1.0, 300)}
    assert generation_rate([group(3, 100)], times) == pytest.approx(50.0)
    # half of slot 4 (150 of its tokens) is charged half its second
    assert generation_rate([group(3, 100), group(4, 150)], times) == pytest.approx(250 / 2.5)
    # a group restored from a checkpoint (slot 1, untimed) counts in neither sum
    assert generation_rate([group(1, 80), group(4, 300)], times) == pytest.approx(300.0)
    assert generation_rate([group(1, 80)], times) is None


def test_the_restored_line_says_what_from_which_iteration_with_a_short_digest():
    data = {"epoch": 1, "offset": 16, "size": 64, "shuffle": True, "digest": "ab12cd34" * 8}
    line = restored_line("/runs/a/iter_0000003", 3, 6, data)
    assert line == (
        "restored iteration 3 (/runs/a/iter_0000003): optimizer step 6, "
        "data epoch 1 at prompt 16 of 64 (shuffled, digest ab12cd34)"
    )
    assert "{" not in line and data["digest"] not in line
    # --no-load-data style resumes (the data position not restored) and release/ checkpoints
    assert restored_line("/runs/a/release", None, 0, None) == (
        "restored /runs/a/release: optimizer step 0"
    )


def plan_note(*args: str) -> str | None:
    return RunConfig.from_args(build_parser().parse_args(["plan", *args])).demo_note()


def test_the_plan_names_the_defaults_that_apply_demo_or_miles():
    demo = plan_note()
    assert demo.startswith("defaults: the built-in demo's --lr 0.0001 --adam-beta2 0.98 ")
    assert "DEMO_DEFAULTS" not in demo and "run_config" not in demo
    # a model of one's own: the demo's values drop, and the line says which ones replace them
    own = plan_note("--hf-checkpoint", "/models/mine")
    assert own.startswith(
        "defaults: miles' --lr 1e-06 --adam-beta2 0.999 --weight-decay 0.01 "
        "--lr-decay-style linear without --calculate-per-token-loss"
    ), own
    # a flag given is never called a default
    given = plan_note("--hf-checkpoint", "/models/mine", "--lr", "1e-5")
    assert "--lr " not in given and "--adam-beta2 0.999" in given
