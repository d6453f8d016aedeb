"""reasoning-gym tasks as prompt data: the spec, determinism, the held-out split, the task's own
scorer as the reward, and an exact resume of a training run on one."""

from __future__ import annotations

import json

import pytest
from conftest import fast_train_args

from mileage.checkpoint.inspect import list_checkpoints
from mileage.errors import UserError
from mileage.rollout.data import DataConfig, load_eval_sets, load_train_prompts, task_reward
from mileage.rollout.gym import EVAL_SEED_OFFSET, GymSpec, extract_answer, parse_gym_spec

ONE_DIGIT = "basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1&operators=+,-"


def test_spec_parsing():
    spec = parse_gym_spec(
        "gym:basic_arithmetic?size=5&seed=1&operators=+,-&max_digits=1&allow_negation=false"
        "&instruction=Reply with only the number."
    )
    assert spec == GymSpec(
        "basic_arithmetic",
        5,
        1,
        (("allow_negation", False), ("max_digits", 1), ("operators", ("+", "-"))),
        "Reply with only the number.",
    )
    assert parse_gym_spec("gym:chain_sum") == GymSpec("chain_sum", 1000, 0)
    held_out = spec.held_out()
    assert (held_out.size, held_out.seed, held_out.options) == (
        100,
        1 + EVAL_SEED_OFFSET,
        spec.options,
    )
    larger = parse_gym_spec("gym:basic_arithmetic?size=5&seed=1&eval_size=400")
    assert larger.held_out().size == 400 and larger.options == ()
    assert str(larger) == "gym:basic_arithmetic?size=5&seed=1&eval_size=400"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gym:", "name a reasoning-gym task"),
        ("gym:basic_arithmetic?size=-1", "size must be a non-negative integer"),
        ("gym:basic_arithmetic?size=0", "size and eval_size must be positive"),
        ("gym:basic_arithmetic?seed=x", "seed must be a non-negative integer"),
        ("gym:basic_arithmetic?eval_size=0", "size and eval_size must be positive"),
        ("gym:basic_arithmetic?oops", "'oops' is not KEY=VALUE"),
    ],
)
def test_bad_specs_are_user_errors(text, message):
    with pytest.raises(UserError, match=message):
        parse_gym_spec(text)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "gym:no_such_task",
            "unknown reasoning-gym task 'no_such_task'; known: .*basic_arithmetic",
        ),
        ("gym:basic_arithmetic?no_such_option=1", "refused"),
        ("gym:basic_arithmetic?min_digits=3&max_digits=1", "refused"),
    ],
)
def test_bad_tasks_are_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        load_train_prompts(DataConfig(prompt_data=spec))


def test_prompts_are_the_same_on_every_machine():
    cfg = DataConfig(prompt_data=f"gym:{ONE_DIGIT}&size=5&seed=1")
    prompts = load_train_prompts(cfg)
    # checked by hand against reasoning-gym 0.1.25: item i comes from Random(seed + i)
    assert [(p.index, p.text, p.label) for p in prompts[:3]] == [
        (0, "Calculate 5 - 3.", "2"),
        (1, "Calculate 2 + -1.", "1"),
        (2, "Calculate ( -9 - 8 ).", "-17"),
    ]
    assert load_train_prompts(cfg) == prompts
    other_seed = load_train_prompts(DataConfig(prompt_data=f"gym:{ONE_DIGIT}&size=5&seed=2"))
    # item 0 of seed 2 is item 1 of seed 1: why the held-out split's seed is far away
    assert other_seed[0].text == prompts[1].text


def test_held_out_split_is_disjoint_and_scored_by_the_task():
    spec = "gym:basic_arithmetic?size=300&seed=3&max_terms=2&max_digits=2&operators=+"
    cfg = DataConfig(prompt_data=spec)
    train, (held_out_set,) = load_train_prompts(cfg), load_eval_sets(cfg)
    held_out = held_out_set.prompts
    assert held_out_set.name == "basic_arithmetic"  # named after the task
    assert len(train) == 300 and len(held_out) == 100
    assert not {p.text for p in train} & {p.text for p in held_out}
    explicit = DataConfig(prompt_data=spec, eval_prompt_data=[spec.replace("size=300", "size=7")])
    # an explicit eval spec is taken as given
    assert [(s.name, s.prompts) for s in load_eval_sets(explicit)] == [
        ("basic_arithmetic", train[:7])
    ]
    reward = task_reward(cfg)
    item = held_out[0]
    assert reward(item.text, item.label, item.label) == 1.0
    assert reward(item.text, f"<answer>{item.label}</answer>", item.label) == 1.0
    # reasoning-gym's default scorer: partial credit len(answer) / len(response) when contained
    padded = f"it is {item.label}"
    assert reward(item.text, padded, item.label) == pytest.approx(len(item.label) / len(padded))
    assert reward(item.text, "nothing", item.label) == 0.0
    with pytest.raises(UserError, match="can only grade prompts of its gym: task"):
        reward("a prompt from elsewhere", "1", "1")
    assert task_reward(DataConfig()) is None


def test_instruction_is_appended_and_scored():
    cfg = DataConfig(prompt_data=f"gym:{ONE_DIGIT}&size=3&seed=1&instruction=Only the number.")
    first = load_train_prompts(cfg)[0]
    assert first.text == "Calculate 5 - 3. Only the number."
    assert task_reward(cfg)(first.text, " 2\n", first.label) == 1.0


def test_extract_answer():
    assert extract_answer("<answer>1</answer> or <answer> 7 </answer>") == "7"
    assert extract_answer("  42 \n") == "42"


def test_training_on_a_gym_task_resumes_exactly(tmp_path, cli, tiny_hf):
    """2 rollouts straight == 1 rollout, exit, resume 1. The random tiny model writes random
    characters; with 32 samples of 8 of them per rollout some contain the one-digit answer and
    earn the task's partial credit, so both rollouts train (a comparison of unchanged weights
    would prove nothing)."""
    task = "gym:basic_arithmetic?size=40&seed=5&max_terms=2&max_digits=1&operators=+"
    args = [
        "train",
        *fast_train_args(tiny_hf, "--prompt-data", task, "--num-rollout", "2"),
        *("--rollout-batch-size", "8", "--rollout-max-response-len", "8"),
        *("--save-interval", "1", "--rollout-shuffle"),
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = cli(*args, "--save", straight, "--load", straight)
    assert first.returncode == 0, first.stderr
    part = cli(*args, "--save", resumed, "--load", resumed, "--debug-exit-after-rollout", "1")
    assert part.returncode == 0 and "stopped after rollout 0" in part.stdout + part.stderr
    rest = cli(*args, "--save", resumed, "--load", resumed)
    assert rest.returncode == 0, rest.stderr

    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert any(r["reward_mean"] > 0 for r in records), records
    assert all(r["grad_norm"] > 0 for r in records), records  # both rollouts trained
    a, b = list_checkpoints(straight), list_checkpoints(resumed)
    assert [r["name"] for r in a] == [r["name"] for r in b] == ["iter_0000000", "iter_0000001"]
    assert a[0]["model_digest"] != a[1]["model_digest"]  # the weights moved: not a vacuous compare
    for x, y in zip(a, b, strict=True):
        assert (x["model_digest"], x["optimizer_digest"]) == (
            y["model_digest"],
            y["optimizer_digest"],
        )
    resumed_records = [
        json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["prompt_indices"] for r in resumed_records] == [r["prompt_indices"] for r in records]
    assert [r["reward_mean"] for r in resumed_records] == [r["reward_mean"] for r in records]
