"""Black-box agents (--agent-function-path) against a scripted calculator model: the endpoint
speaks the OpenAI API to the official `openai` client, trajectories are the engine's ids
(token-in/token-out, never re-tokenized), a rewritten history splits the trajectory, the journal
gives a rerun the first run's completions until an agent diverges, and a misbehaving agent ends
only its own sample."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

from mileage.errors import UserError
from mileage.models.tiny import build_char_tokenizer
from mileage.rollout import tool_task
from mileage.rollout.agent import Agent, load_user_functions
from mileage.rollout.agents import session
from mileage.rollout.data import Prompt
from mileage.rollout.engines.base import Completion, SamplingParams
from mileage.rollout.multiturn import MultiTurnConfig
from mileage.rollout.rollout import PromptEncoder, generate_samples
from mileage.rollout.sample import (
    AGENT_BAD_RETURN,
    AGENT_ERROR,
    AGENT_NO_CALLS,
    AGENT_TIMEOUT,
    STOP,
    tool_metrics,
)
from mileage.rollout.tasks import builtin_alphabet

FNS = str(Path(__file__).with_name("agent_fns.py"))
EXAMPLE = str(Path(__file__).parents[1] / "examples" / "openai_agent.py")
PARAMS = SamplingParams(max_new_tokens=16)
PROMPTS = [Prompt(0, "12345+11111=", "23456"), Prompt(1, "50000+50000=", "100000")]
# a chat template over the character alphabet: role letters, and the assistant's turn ending
# with the end-of-sequence token (as Qwen's ends with <|im_end|>)
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}U:{{ m.content }}|"
    "{% elif m.role == 'assistant' %}A:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.arguments.expression }}]{% endfor %}<eos>"
    "{% elif m.role == 'tool' %}T:{{ m.content }}|"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


class CalcEngine:
    """A model that calls the calculator on a fresh question and copies its answer back: after
    `=` it says `[a+b]`, after a tool's output it says the output's digits."""

    in_process = False

    def __init__(self, tok, noise: bool = False):
        self.tok, self.weight_version = tok, 1
        self.calls: list[list[list[int]]] = []
        # an answer starting with <unk>, which its text does not show: re-tokenizing the
        # text would lose it
        self.noise = noise

    def generate(self, prompts, params, seed=None, group_size=1):
        self.calls.append([list(p) for p in prompts])
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=True)
            tail = text.rstrip("|A:")
            if tail.endswith("="):
                question = tail[tail.rindex(":") + 1 if ":" in tail else 0 : -1]
                answer = f"[{question.lstrip('|')}]"
            else:
                answer = "".join(ch for ch in tail[-7:] if ch.isdigit())
            ids_out = self.tok(answer, add_special_tokens=False)["input_ids"]
            if self.noise:
                ids_out = [self.tok.unk_token_id, *ids_out]
            ids_out = (ids_out + [self.tok.eos_token_id])[: params.max_new_tokens]
            finished = ids_out[-1] == self.tok.eos_token_id
            logprobs = [-0.5 - 0.01 * i for i in range(len(ids_out))]
            out.append(Completion(list(ids), ids_out, logprobs, finished, self.weight_version))
        return out

    def update_weights(self, model, version):
        self.weight_version = version

    def close(self):
        pass


def tokenizer(template: bool = False):
    tok = build_char_tokenizer(builtin_alphabet("addition-tool") + "UAT:|")
    if template:
        tok.chat_template = TEMPLATE
    return tok


def make_agent(fn: str, journal=None, tok=None, context: int = 64, **flags):
    mt = MultiTurnConfig(agent_function_path=fn, generate_tool_call_parser="calc", **flags)
    config = Namespace(
        multiturn=mt,
        reward=Namespace(group_rm=False),
        rollout=Namespace(n_samples_per_prompt=2, rollout_batch_size=2),
    )
    tok = tok or tokenizer()
    encode = PromptEncoder(tok, False)
    agent = Agent(
        config, load_user_functions(mt), tok, encode, tool_task.tool_task_reward, journal, context
    )
    return agent, tok, encode


def rollout(agent, tok, encode, prompts=PROMPTS, n=2, slot=3, engine=None):
    engine = engine or CalcEngine(tok)
    try:
        samples = generate_samples(
            engine, encode, prompts, PARAMS, n, agent.reward_fn, 7, slot, agent
        )
    finally:
        agent.close()
    return samples, engine


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def probed():
    agent, tok, encode = make_agent(f"{FNS}:protocol_probe", context=64)
    samples, _ = rollout(agent, tok, encode, PROMPTS[:1], n=1)
    return sys.modules[agent.user.agent.__module__].RESULTS[0], samples, tok


def test_chat_replies_tool_calls_and_logprobs(probed):
    seen, samples, tok = probed
    first = seen["first"]
    assert seen["models"] == ["mileage-policy"]
    assert first["finish"] == "tool_calls" and first["content"] is None
    assert first["call"] == ("calculator", '{"expression": "12345+11111"}')
    assert first["token_ids"] == ids(tok, "[12345+11111]") + [tok.eos_token_id]
    assert first["logprobs"] == [-0.5 - 0.01 * i for i in range(len(first["token_ids"]))]
    assert first["prompt_token_ids"] == tok("12345+11111=")["input_ids"]
    assert first["usage"]["completion_tokens"] == len(first["token_ids"])
    assert seen["n2"] == 2
    assert seen["by_header"] == "tool_calls"
    assert samples[0].reward == 1.0  # the agent's own reward, not the task's


def test_streams_limits_and_stops(probed):
    seen, _, _ = probed
    assert seen["stream"]["calls"] == [("calculator", '{"expression": "12345+11111"}')]
    assert seen["stream"]["finish"] == "tool_calls"
    assert seen["stream"]["usage"]["completion_tokens"] == 14
    assert seen["short"] == ("23", "length")  # max_tokens=2
    assert seen["stopped"] == ("23", "stop")  # stop="4": the text before it
    assert seen["streamed_text"] == "23456"
    assert seen["completion"] == ("[12345+11111]", "stop")
    assert seen["completion_stream"] == "[12345+11111]"
    assert seen["completion_ids"] == "[12345+11111]"


@pytest.mark.parametrize(
    ("case", "status", "words"),
    [
        ("empty", 400, "messages must be a non-empty list"),
        ("n0", 400, "n must be an integer >= 1"),
        ("top_logprobs", 400, "sampled token's log-prob only"),
        ("too_long", 400, "the run's context limit is 64"),
        ("bad_key", 401, "unknown API key"),
        ("too_large", 413, "at most"),
        ("no_route", 404, "no route POST /v1/embeddings"),
    ],
)
def test_bad_requests_get_openai_errors(probed, case, status, words):
    got_status, body = probed[0]["errors"][case]
    assert got_status == status
    error = body.get("error", body)  # the openai client hands over the "error" object
    assert words in error["message"] and error["type"]


def test_trajectory_is_the_engine_s_ids_and_the_tool_s(tmp_path):
    """The example agent through a chat template: the trained ids are the first prompt's
    rendering, the engine's ids and what the template appends for the tool message, and each
    engine call's input is exactly the trajectory so far (nothing re-tokenized)."""
    agent, tok, encode = make_agent(f"{EXAMPLE}:agent", tok=tokenizer(template=True))
    samples, engine = rollout(agent, tok, encode, PROMPTS[:1], n=1, engine=CalcEngine(tok, True))
    sample = samples[0]
    eos, unk = tok.eos_token_id, tok.unk_token_id
    turn_1, turn_2 = engine.calls[0][0], engine.calls[1][0]
    answer_1 = [unk, *ids(tok, "[12345+11111]"), eos]
    assert turn_1 == tok.apply_chat_template(
        [{"role": "user", "content": "12345+11111="}], add_generation_prompt=True,
        return_dict=False,
    )  # fmt: skip
    assert turn_2 == turn_1 + answer_1 + ids(tok, "T:23456|A:")
    assert sample.prompt_ids + sample.response_ids == turn_2 + [unk, *ids(tok, "23456"), eos]
    model = [1] * len(answer_1) + [0] * len(ids(tok, "T:23456|A:")) + [1] * 7
    assert sample.loss_mask == model and sample.stop_reason == STOP and sample.finished
    assert sample.agent_stats["splits"] == 0
    assert tool_metrics(samples)["rollout/tool_calls"] == 1.0


def test_the_plain_format_matches_the_built_in_tool_loop():
    """Without a template the example agent's trajectory is the built-in tool loop's format."""
    agent, tok, encode = make_agent(f"{EXAMPLE}:agent")
    samples, engine = rollout(agent, tok, encode)
    expect = ids(tok, "[50000+50000]") + [2] + ids(tok, "{100000}100000") + [2]
    assert samples[2].response_ids == expect
    assert samples[2].loss_mask == [1] * 14 + [0] * 8 + [1] * 7
    assert [s.reward for s in samples] == [1.0] * 4
    assert [len(c) for c in engine.calls] == [4, 4]  # turn-synchronous: every sample per call


def test_a_rewritten_history_splits_the_trajectory():
    agent, tok, encode = make_agent(f"{FNS}:splitter", tok=tokenizer(template=True))
    samples, engine = rollout(agent, tok, encode, PROMPTS[:1], n=1)
    stats = samples[0].agent_stats
    assert stats["segments"] == 2 and stats["splits"] == 1
    assert stats["untrained_tokens"] == len(ids(tok, "[12345+11111]")) + 1
    # the trained segment is the rewritten conversation's rendering and its answer
    assert samples[0].prompt_ids == engine.calls[1][0]
    assert tool_metrics(samples)["rollout/agent_splits"] == 1.0


def test_max_concurrency_bounds_the_batches_and_changes_no_sample():
    free, tok, encode = make_agent(f"{EXAMPLE}:agent")
    unbounded, _ = rollout(free, tok, encode)
    bounded_agent, tok, encode = make_agent(f"{EXAMPLE}:agent", agent_max_concurrency=1)
    bounded, engine = rollout(bounded_agent, tok, encode)
    assert max(len(c) for c in engine.calls) == 1
    assert [s.to_record() for s in bounded] == [s.to_record() for s in unbounded]


def test_the_journal_replays_a_rerun_and_stops_at_a_divergence(tmp_path, capsys):
    journal = tmp_path / "journal"
    agent, tok, encode = make_agent(f"{EXAMPLE}:agent", journal)
    first, _ = rollout(agent, tok, encode)
    agent, tok, encode = make_agent(f"{EXAMPLE}:agent", journal)
    again, engine = rollout(agent, tok, encode)
    assert engine.calls == []  # every completion came from the journal
    assert [s.to_record() for s in again] == [s.to_record() for s in first]

    # an agent whose second request changes from run to run: the first request is replayed,
    # the second diverges, and the third, though the journal holds an equal one, is generated
    agent, tok, encode = make_agent(f"{FNS}:nondet", journal)
    rollout(agent, tok, encode, PROMPTS[:1], n=1, slot=4)
    agent, tok, encode = make_agent(f"{FNS}:nondet", journal)
    capsys.readouterr()
    samples, engine = rollout(agent, tok, encode, PROMPTS[:1], n=1, slot=4)
    assert [len(c) for c in engine.calls] == [1, 1]  # the second and the third request
    assert engine.calls[1][0] == tok("7+7=")["input_ids"]
    assert samples[0].agent_stats["diverged"] == 1.0
    assert "asked other than the journal recorded" in capsys.readouterr().err


def test_a_misbehaving_agent_ends_only_its_sample(capsys):
    prompts = [Prompt(i, f"{i}1111+11111=", str(int(f"{i}1111") + 11111)) for i in range(5)]
    agent, tok, encode = make_agent(f"{FNS}:misbehaving", agent_timeout=0.5)
    samples, _ = rollout(agent, tok, encode, prompts, n=1)
    reasons = [s.stop_reason for s in samples]
    assert reasons == [AGENT_ERROR, AGENT_TIMEOUT, AGENT_BAD_RETURN, AGENT_NO_CALLS, STOP]
    for s in samples[:4]:
        assert s.reward == 0.0 and not any(s.mask()) and s.agent_failure
    assert samples[4].reward == 0.5 and all(samples[4].mask())
    assert "ValueError: the agent's own bug at " in samples[0].agent_failure
    assert "agent_fns.py" in samples[0].agent_failure
    assert "returned 'high'" in samples[2].agent_failure
    assert tool_metrics(samples)["rollout/agent_failures"] == 4.0
    assert tool_metrics(samples)["rollout/stop_agent_timeout"] == 0.2
    err = capsys.readouterr().err
    assert "agent: sample 0 (prompt 0): agent_error: raised ValueError" in err
    assert "and 1 more" in err


def test_a_sync_agent_runs_in_a_thread():
    agent, tok, encode = make_agent(f"{FNS}:sync_ok")
    samples, _ = rollout(agent, tok, encode, PROMPTS[:1], n=2)
    assert [s.reward for s in samples] == [0.25, 0.25]


def test_an_agent_blocking_the_event_loop_stops_the_run(monkeypatch):
    monkeypatch.setattr(session, "CANCEL_GRACE_S", 0.3)
    agent, tok, encode = make_agent(f"{FNS}:blocking", agent_timeout=0.2)
    with pytest.raises(UserError, match="blocks the event loop"):
        rollout(agent, tok, encode, PROMPTS[:1], n=1)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"agent_function_path": "nowhere.py:agent"}, "nowhere.py is not a file"),
        ({"agent_function_path": f"{FNS}:TOOLS"}, "has no function 'TOOLS'"),
        (
            {"agent_function_path": f"{FNS}:sync_ok", "custom_generate_function_path": "x:y"},
            "both say how samples are generated",
        ),
        ({"agent_function_path": f"{FNS}:sync_ok", "agent_timeout": 0.0}, "--agent-timeout"),
    ],
)
def test_agent_flags_refused_in_one_line(flags, words):
    with pytest.raises(UserError, match=words):
        load_user_functions(MultiTurnConfig(**flags))
