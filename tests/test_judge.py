"""LLM-judge rewards (`--rm-type llm_judge`): the score parser on well-formed and malformed
replies, the prompt template, the judge client against a stand-in OpenAI-compatible server
(tests/judge_server.py), and the journal that replays a round's rewards only for the samples
they were given to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from judge_server import StandIn

from mileage.errors import UserError
from mileage.rollout.journal import ToolJournal
from mileage.rollout.rewards import RewardConfig, build_reward_fn, score_all
from mileage.rollout.rewards.journaled import journaled, replay_or_score, scored_once
from mileage.rollout.rewards.judge import (
    DEFAULT_TEMPLATE,
    JudgeReplyError,
    JudgeReward,
    load_template,
    parse_score,
    render,
)
from mileage.rollout.rewards.rules import RULES


@pytest.fixture
def stand_in(tmp_path):
    started: list[StandIn] = []

    def start(mode: str, *extra: str) -> StandIn:
        started.append(StandIn(tmp_path, mode, *extra))
        return started[-1]

    yield start
    for judge in started:
        judge.stop()


@pytest.mark.parametrize(
    "reply, score",
    [
        ("Score: 7", 0.7),
        ("The answer is close.\n**Score:** 8/10", 0.8),
        ("rating = 3 out of 10", 0.3),
        ("Score: 2. On reflection the answer is right. Final score: 9", 0.9),  # the last counts
        ('{"score": 10, "reason": "exact"}', 1.0),
        ('Here you go:\n```json\n{"score": 4}\n```', 0.4),
        ("[[6]]", 0.6),
        ("5", 0.5),
        ("0.5/10.", 0.05),
        ("<think>Score: 1? no</think>Score: 7", 0.7),  # reasoning is skipped
        ("The response scores highly. Grade: 10", 1.0),  # "scores" is not the label
    ],
)
def test_the_parser_reads_the_usual_ways_a_judge_writes_a_score(reply, score):
    assert parse_score(reply, 10.0) == pytest.approx(score)


@pytest.mark.parametrize(
    "reply, why",
    [
        ("", "holds no score"),
        ("I cannot grade this.", "holds no score"),
        ("The answer 42 is wrong.", "holds no score"),  # a number, but not a score
        ("Score: N", "holds no score"),
        ("Score: 11", "outside [0, 10]"),
        ("Score: -1", "outside [0, 10]"),
        ("Score: 4/5", "out of 5 where --judge-max-score is 10"),
        ('{"score": "high"}', "holds no score"),
        ("<think>Let me weigh the answer. Score: 3 would be", "ends inside <think>"),
    ],
)
def test_an_unreadable_reply_is_a_named_failure_never_a_zero(reply, why):
    with pytest.raises(JudgeReplyError) as err:
        parse_score(reply, 10.0)
    assert why in str(err.value)
    assert str(err.value).startswith("replied ")


def test_the_template_is_filled_once_and_leaves_other_braces_alone(tmp_path):
    text = render(
        'Q {prompt} A {response} ref {label} /{max_score} {"score": N} {other}',
        prompt="2+2 {label}", response="4", label="4", max_score="10",
    )  # fmt: skip
    # a value holding a placeholder is not filled again; a JSON example stays as written
    assert text == 'Q 2+2 {label} A 4 ref 4 /10 {"score": N} {other}'
    assert "{response}" in DEFAULT_TEMPLATE and load_template(None) == DEFAULT_TEMPLATE
    blind = tmp_path / "blind.txt"
    blind.write_text("Grade {prompt}")
    with pytest.raises(UserError, match="no \\{response\\} placeholder"):
        load_template(str(blind))
    with pytest.raises(UserError, match="cannot read it"):
        load_template(str(tmp_path / "missing.txt"))


def judge_config(url: str, **overrides) -> RewardConfig:
    return RewardConfig(rm_type="llm_judge", rm_url=url, rm_retries=1, rm_timeout=10.0, **overrides)


def test_the_judge_scores_through_an_openai_compatible_server(stand_in):
    judge = build_reward_fn(judge_config(stand_in("graded").url))
    assert isinstance(judge, JudgeReward) and journaled(judge)
    assert judge.model == "stand-in-judge"  # the first model the server lists
    assert judge.plan_line.startswith(
        f"reward: the LLM judge {judge.base} (model stand-in-judge, score / 10, temperature 0);"
    )
    # whole marks for the label, half for its first character, else none (over 10)
    assert score_all(judge, [("1+2=", "12", "9"), ("1+2=", "3", "3"), ("q", "93", "97")]) == [
        0.0,
        1.0,
        0.5,
    ]
    body = judge.body("1+2=", "3", "3")
    assert body["model"] == "stand-in-judge" and body["temperature"] == 0.0
    assert body == judge.body("1+2=", "3", "3")  # the same request asks with the same seed
    named = build_reward_fn(
        judge_config(stand_in("think").url, judge_model="m", judge_max_score=10)
    )
    assert named.body("p", "r", "l")["model"] == "m"
    assert score_all(named, [("p", "r", "l")]) == [pytest.approx(0.7)]


def test_a_judge_that_answers_garbage_stops_the_run_quoting_its_reply(stand_in):
    judge = build_reward_fn(judge_config(stand_in("garbage").url))
    with pytest.raises(UserError) as err:
        score_all(judge, [("1+2=", "3", "3")])
    message = str(err.value)
    assert "the LLM judge http://127.0.0.1:" in message
    assert "replied 'I cannot grade this.', which holds no score" in message
    assert "(attempt 2 of 2;" in message and "the last checkpoint is unchanged" in message
    assert "\n" not in message


def test_an_unreachable_or_wrong_judge_is_refused_before_anything_runs(stand_in, tmp_path):
    judge = stand_in("graded")
    url = judge.url
    judge.stop()
    with pytest.raises(UserError, match=r"unreachable .* when asked for /models; --rm-url takes"):
        build_reward_fn(judge_config(url))
    with pytest.raises(UserError, match="needs --rm-url"):
        build_reward_fn(RewardConfig(rm_type="llm_judge"))
    with pytest.raises(UserError, match="--judge-max-score and --judge-max-tokens must be"):
        build_reward_fn(judge_config(url, judge_max_score=0.0))
    # judge flags without the judge would do nothing
    with pytest.raises(UserError, match="--judge-model, --judge-max-score configure the LLM judge"):
        RewardConfig(judge_model="m", judge_max_score=5.0).validate()
    RewardConfig(rm_type="llm_judge", judge_model="m").validate()


def sample(index: int, response: str) -> SimpleNamespace:
    prompt = SimpleNamespace(index=index, text=f"{index}+1=", label=str(index + 1))
    return SimpleNamespace(prompt=prompt, response=response, response_ids=[ord(response[0])])


def test_journaled_rewards_replay_only_for_the_samples_they_were_given_to(tmp_path):
    journal = ToolJournal(tmp_path / "journal")
    calls = []

    def score_with(values):
        def score():
            calls.append(values)
            return list(values)

        return score

    round_ = [sample(0, "1"), sample(1, "2"), sample(2, "9")]
    positions = ["0", "1", "2"]
    assert replay_or_score(journal, 4, round_, positions, score_with([0.1, 0.2, 0.3])) == [
        0.1,
        0.2,
        0.3,
    ]
    # a rerun reads the same journal from disk: the recorded rewards, the judge not asked
    reread = ToolJournal(tmp_path / "journal")
    assert replay_or_score(reread, 4, round_, positions, score_with([9, 9, 9])) == [0.1, 0.2, 0.3]
    assert len(calls) == 1 and reread.replayed == 3
    # other samples at the same places (or the same samples elsewhere) are scored afresh
    swapped = [round_[1], round_[0], round_[2]]
    assert replay_or_score(reread, 4, swapped, positions, score_with([5, 6, 7])) == [5, 6, 7]
    assert replay_or_score(reread, 5, round_, positions, score_with([1, 2, 3])) == [1, 2, 3]
    # evaluation (no slot) and runs without --save (no journal directory) just score
    assert replay_or_score(reread, None, round_, positions, score_with([0, 0, 0])) == [0, 0, 0]
    assert len(calls) == 4
    # a rule reward is not journaled (it answers alike every time)
    assert scored_once(RULES["exact"], lambda: [1.0], reread, 6, [sample(0, "1")]) == [1.0]
    assert not (tmp_path / "journal" / "slot_6.jsonl").exists()
