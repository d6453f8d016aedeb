"""Each rule-based reward name against hand-checked values (miles' meaning), and its selection."""

from __future__ import annotations

import pytest

from mileage.errors import UserError
from mileage.rollout.rewards import RM_TYPES, RewardConfig, build_reward_fn
from mileage.rollout.rewards.rules import last_boxed, normalize_final_answer


def reward(name: str, response: str, label: str) -> float:
    return build_reward_fn(RewardConfig(rm_type=name))("prompt", response, label)


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("so \\boxed{7} hmm \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # last box, symbolic equality
        ("\\boxed{\\frac12}", "1/2", 1.0),
        ("\\boxed{x+1}", "1+x", 1.0),
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{12}", "\\boxed{12}", 1.0),  # a boxed label is unboxed first
        ("\\boxed{-3}", "3", 0.0),
        ("the answer is 42", "42", 0.0),  # miles' math needs a box
        ("\\boxed{42}", "", 0.0),
        ("\\boxed{}", "42", 0.0),
    ],
)
def test_math(response, label, expected):
    assert reward("math", response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4", 1.0),
        ("<think>\\boxed{4}</think> so \\boxed{3}", "4", 0.0),  # only after </think>
        ("<think>\\boxed{4}</think> no box after", "4", 0.0),
        ("thinking... ###Response \\boxed{0.25}", "1/4", 1.0),
        ("\\boxed{4}", "4", 0.0),  # no </think> and no ###Response
    ],
)
def test_deepscaler(response, label, expected):
    assert reward("deepscaler", response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("work...\nAnswer: 42", "42", 1.0),
        ("Answer: 41\nanswer: 42", "42", 1.0),  # the last answer line
        ("Answer: $1,000$", "1000", 1.0),
        ("Answer: x = 12", "12.0", 1.0),  # after the last '=', label as an integer
        ("Answer: \\boxed{7}", "7", 1.0),
        ("Answer: 42", "43", -1.0),
        ("42", "42", -1.0),  # no answer line
        ("Answer: 5\n" + "x" * 300, "5", -1.0),  # only the last 300 characters count
    ],
)
def test_dapo(response, label, expected):
    assert reward("dapo", response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0),
        ("Paris France", "Paris", 2 * 0.5 * 1.0 / 1.5),  # precision 1/2, recall 1
        ("red green blue", "green blue yellow orange", 2 * (2 / 3) * 0.5 / (2 / 3 + 0.5)),
        ("yes indeed", "yes", 0.0),  # yes/no must match exactly
        ("No.", "no", 1.0),
        ("cat", "dog", 0.0),
    ],
)
def test_f1(response, label, expected):
    assert reward("f1", response, label) == pytest.approx(expected)


def test_exact():
    assert reward("exact", " 25\n", "25") == 1.0 and reward("exact", "250", "25") == 0.0


@pytest.mark.parametrize(
    ("name", "response", "label", "expected"),
    [
        ("boxed_exact", "I think \\boxed{25} is it", "25", 1.0),
        ("boxed_exact", "25", "25", 0.0),  # no box: an empty answer
        ("boxed_math", "first \\boxed{1} then \\boxed{0.5}", "1/2", 1.0),
        ("boxed_deepscaler", "\\boxed{4}", "4", 1.0),  # the box replaces the </think> split
        ("boxed_dapo", "\\boxed{12}", "12", 1.0),
        ("boxed_dapo", "Answer: 12", "12", -1.0),
        ("boxed_f1", "blah blah \\boxed{the eiffel tower}", "Eiffel Tower", 1.0),
        ("boxed_f1", "the eiffel tower", "Eiffel Tower", 0.0),
    ],
)
def test_boxed_prefix_grades_only_the_last_box(name, response, label, expected):
    assert reward(name, response, label) == expected


def test_every_name_is_offered():
    rules = {"exact", "math", "dapo", "deepscaler", "f1", "remote_rm"}
    # and the LLM judge, which grades the whole response (tests/test_judge.py)
    assert set(RM_TYPES) == rules | {f"boxed_{name}" for name in rules} | {"llm_judge"}


def test_default_is_the_task_scorer_else_exact():
    def scorer(prompt, response, label):
        return 0.5

    assert build_reward_fn(RewardConfig(), scorer) is scorer
    assert build_reward_fn(RewardConfig())("p", "25", "25") == 1.0
    # an explicit --rm-type wins over the task's scorer
    assert build_reward_fn(RewardConfig(rm_type="f1"), scorer)("p", "a b", "a b") == 1.0


def test_remote_needs_a_url():
    with pytest.raises(UserError, match="needs --rm-url"):
        build_reward_fn(RewardConfig(rm_type="remote_rm"))
    with pytest.raises(UserError, match="http"):
        build_reward_fn(RewardConfig(rm_type="remote_rm", rm_url="ftp://x"))


def test_helpers():
    assert last_boxed("\\boxed{{3}}") == "{3}" and last_boxed("\\boxed{unclosed") is None
    assert normalize_final_answer("x = \\text{5 units}") == "5"


def test_math_works_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(reward, "math", "\\boxed{\\frac{1}{2}}", "0.5").result() == 1.0
