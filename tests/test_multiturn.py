"""Multi-turn, tool-using rollouts against a scripted engine: the trained ids are the engine's
ids plus the tool's, tool tokens have mask 0, batches are turn-synchronous and seeded per
(rollout, prompt, sample, call), failing tools end only their trajectory, and the tool journal
gives a rerun the outcomes the first run got."""

from __future__ import annotations

import re
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from mileage.errors import UserError
from mileage.models.tiny import build_char_tokenizer
from mileage.rollout.agent import Agent, load_user_functions
from mileage.rollout.data import Prompt
from mileage.rollout.engines.base import Completion, SamplingParams
from mileage.rollout.multiturn import MultiTurnConfig
from mileage.rollout.rollout import PromptEncoder, generate_samples
from mileage.rollout.sample import (
    LENGTH,
    MAX_TURNS,
    STOP,
    TOOL_ERROR,
    TOOL_TIMEOUT,
    Sample,
    tool_metrics,
)
from mileage.rollout.tasks import builtin_alphabet
from mileage.seeding import derive_seed

TOOLS = str(Path(__file__).with_name("multiturn_tools.py"))

# what the scripted model answers to each prompt, turn by turn (turn k = '>' in the context)
SCRIPT = {
    "11+11=": ["13", "2"],  # a tool call, then an answer
    "22+22=": ["4"],  # answers at once
    "33+33=": ["7"],  # the tool raises
    "44+44=": ["9"],  # the tool hangs
    "55+55=": ["1", "3", "5", "1"],  # calls a tool every turn
    "66+66=": ["123456"],  # longer than max_new_tokens
}


class ScriptedEngine:
    """An Engine that answers from SCRIPT and records every call it gets."""

    in_process = False

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.weight_version = 3
        self.calls: list[tuple[list[list[int]], SamplingParams, object]] = []

    def generate(self, prompts, params, seed=None, group_size=1):
        self.calls.append(([list(p) for p in prompts], params, seed))
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=True)
            answer = self.tok(self.answer(text), add_special_tokens=False)["input_ids"]
            finished = len(answer) < params.max_new_tokens
            ids_out = answer + [self.tok.eos_token_id] if finished else answer
            ids_out = ids_out[: params.max_new_tokens]
            logprobs = [-0.25 - 0.01 * i for i in range(len(ids_out))]
            out.append(Completion(list(ids), ids_out, logprobs, finished, self.weight_version))
        return out

    def answer(self, text: str) -> str:
        """What the model writes after `text`: its prompt's answer for the turn it is in."""
        prompt = text[: text.index("=") + 1]
        return SCRIPT[prompt][text.count(">")]

    def update_weights(self, model, version):
        self.weight_version = version

    def close(self):
        pass


def make_config(**multiturn) -> Namespace:
    mt = MultiTurnConfig(
        generate_execute_tool_function_path=f"{TOOLS}:tool",
        generate_tool_call_parser="odd_digit",
        generate_max_turns=3,
        tool_timeout=2.0,
        tool_workers=2,
    )
    for key, value in multiturn.items():
        setattr(mt, key, value)
    rollout = Namespace(n_samples_per_prompt=2, rollout_batch_size=len(SCRIPT))
    return Namespace(multiturn=mt, reward=Namespace(group_rm=False), rollout=rollout)


def build_agent(config, journal_dir=None, reward=None):
    tok = build_char_tokenizer(builtin_alphabet())
    user = load_user_functions(config.multiturn)
    encode = PromptEncoder(tok, False)

    def exact(prompt, response, label):
        return float(response == label)

    return Agent(config, user, tok, encode, reward or exact, journal_dir, 64), tok, encode


PROMPTS = [Prompt(i, text, "x") for i, text in enumerate(SCRIPT)]
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """One rollout of the scripted engine (rollout id 5, seed 7), shared by the checks below."""
    config = make_config()
    agent, tok, encode = build_agent(config, tmp_path_factory.mktemp("journal"))
    engine = ScriptedEngine(tok)
    try:
        samples = generate_samples(engine, encode, PROMPTS, PARAMS, 2, agent.reward_fn, 7, 5, agent)
    finally:
        agent.close()
    return samples, engine, tok


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_trained_ids_are_the_engines_and_the_tools(rollout):
    samples, engine, tok = rollout
    eos = tok.eos_token_id
    first = samples[0]  # "11+11=": "13" calls rev -> "31", then "2"
    model_1 = ids(tok, "13") + [eos]
    tool_ids = ids(tok, "=31>")
    model_2 = ids(tok, "2") + [eos]
    assert first.response_ids == model_1 + tool_ids + model_2
    assert first.loss_mask == [1] * len(model_1) + [0] * len(tool_ids) + [1] * len(model_2)
    assert first.logprobs[len(model_1) : len(model_1) + len(tool_ids)] == [0.0] * len(tool_ids)
    assert first.stop_reason == STOP and first.turns == 2 and first.finished
    assert [(c.name, c.arguments, c.status, c.output) for c in first.tool_calls] == [
        ("rev", {"x": "13"}, "ok", "31")
    ]
    assert first.tool_calls[0].output_ids == tool_ids
    assert first.weight_versions == [3] * len(first.response_ids)
    # never re-tokenized: turn 2's input is exactly the prompt + turn 1's ids + the tool's ids
    second_turn_inputs = engine.calls[1][0]
    assert second_turn_inputs[0] == first.prompt_ids + model_1 + tool_ids
    # every model span is what the engine returned, token for token
    returned = [c for call in engine.calls for c in call[0]]
    assert first.prompt_ids + model_1 + tool_ids in returned


def test_stop_reasons_and_counts(rollout):
    samples, _, _ = rollout
    reasons = [s.stop_reason for s in samples[::2]]
    assert reasons == [STOP, STOP, TOOL_ERROR, TOOL_TIMEOUT, MAX_TURNS, LENGTH]
    error = samples[4].tool_calls[0]
    assert error.status == TOOL_ERROR and "ValueError: cannot handle 7" in error.output
    assert samples[6].tool_calls[0].status == TOOL_TIMEOUT
    assert samples[8].turns == 3 and len(samples[8].tool_calls) == 2
    assert not samples[10].finished and samples[10].loss_mask == [1] * 4
    for s in samples:
        s.check()
        assert all(m == 0 for m, lp in zip(s.mask(), s.logprobs, strict=True) if lp == 0.0)
    metrics = tool_metrics(samples)
    # per sample: 1 + 0 + 1 + 1 + 2 + 0 calls, two samples each
    assert metrics["rollout/tool_calls"] == 10.0
    assert metrics["rollout/tool_errors"] == 2.0
    assert metrics["rollout/tool_timeouts"] == 2.0
    assert metrics["rollout/mean_turns"] == (2 + 1 + 1 + 1 + 3 + 1) / 6


def test_turn_synchronous_batches_and_seeds(rollout):
    _, engine, _ = rollout
    rows_per_call = [len(prompts) for prompts, _, _ in engine.calls]
    # turn 0: all 12 samples; turn 1: the two "11+11=" and two "55+55="; turn 2: "55+55=" only
    assert rows_per_call == [12, 4, 2]
    prompts0, _, seeds0 = engine.calls[0]
    expected = [
        derive_seed(7, f"rollout/5/{p}/{j}", 0) & ((1 << 31) - 1)
        for p in range(6)
        for j in range(2)
    ]
    assert list(seeds0.seeds) == expected
    assert [seeds0.row_seed(i) for i in range(12)] == expected
    _, _, seeds1 = engine.calls[1]
    assert list(seeds1.seeds) == [
        derive_seed(7, f"rollout/5/{p}/{j}", 1) & ((1 << 31) - 1) for p in (0, 4) for j in (0, 1)
    ]


def test_tool_journal_gives_a_rerun_the_first_outcomes(tmp_path):
    """A tool with outside state answers differently each call; a rerun of the rollout over the
    same journal gets the first run's answers (and calls nothing)."""
    config = make_config(generate_execute_tool_function_path=f"{TOOLS}:tool_nondet")
    runs = []
    for _ in range(2):
        agent, tok, encode = build_agent(config, tmp_path / "journal")
        try:
            samples = generate_samples(
                ScriptedEngine(tok), encode, PROMPTS[:2], PARAMS, 2, agent.reward_fn, 7, 9, agent
            )
        finally:
            agent.close()
        runs.append((samples, agent.journal.replayed, agent.pool._started))
    (first, replayed_1, started_1), (second, replayed_2, started_2) = runs
    assert replayed_1 == 0 and started_1 > 0
    assert replayed_2 == 2 and started_2 == 0  # both "11+11=" samples' calls, no worker started
    assert [s.to_record() for s in second] == [s.to_record() for s in first]
    agent.journal.prune(10)
    assert not list((tmp_path / "journal").glob("slot_*.jsonl"))


def test_sample_records_round_trip_and_old_files_load():
    tok = build_char_tokenizer(builtin_alphabet())
    config = make_config()
    agent, tok, encode = build_agent(config)
    try:
        samples = generate_samples(
            ScriptedEngine(tok), encode, PROMPTS[:1], PARAMS, 1, agent.reward_fn, 1, 0, agent
        )
    finally:
        agent.close()
    record = samples[0].to_record()
    assert Sample.from_record(record) == samples[0]
    old = {
        k: v
        for k, v in record.items()
        if k not in ("loss_mask", "tool_calls", "turns", "stop_reason", "metadata")
    }
    loaded = Sample.from_record(old)
    assert loaded.loss_mask is None and loaded.mask() == [1] * len(loaded.response_ids)


def test_tool_tokens_carry_no_gradient(tiny_hf):
    """The packed loss over a multi-turn sample equals a reference computed over the model's
    tokens only, and garbage in the tool positions' log-probs/advantages changes nothing."""
    from transformers import AutoModelForCausalLM

    from mileage.training.actor import sequence_logprobs
    from mileage.training.batch import pack_samples
    from mileage.training.losses import LossReducer, ppo_clip_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_hf).float()
    prompt = Prompt(0, "11+11=", "22")
    response = [5, 6, 2, 12, 4, 4, 13, 7, 2]
    mask = [1, 1, 1, 0, 0, 0, 0, 1, 1]
    sample = Sample(prompt, [1, 5, 5, 11, 5, 5, 12], response, [-0.5] * 9, "", 1.0, True)
    sample.loss_mask = mask

    def loss_and_grads(tool_value: float):
        s = Sample.from_record(sample.to_record())
        s.logprobs = [lp if m else tool_value for lp, m in zip(s.logprobs, mask, strict=True)]
        batch = pack_samples([s], 0)
        model.zero_grad()
        logp, _ = sequence_logprobs(model, batch, 1.0)
        advantages = torch.where(batch.loss_mask > 0, 1.0, tool_value)
        per_token, _ = ppo_clip_loss(
            logp, batch.old_logprobs, advantages, batch.loss_mask, 0.2, 0.2
        )
        loss = LossReducer(batch.loss_mask, True, float(batch.loss_mask.sum()))(per_token)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return loss.detach(), grads, logp.detach(), batch

    loss, grads, logp, batch = loss_and_grads(0.0)
    loss_junk, grads_junk, _, _ = loss_and_grads(1e3)
    assert torch.equal(loss, loss_junk)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_junk, strict=True))
    # the reference drops the tool tokens: -mean over the model tokens of A * ratio
    p = len(sample.prompt_ids)
    keep = torch.tensor([p - 1 + i for i, m in enumerate(mask) if m])
    assert batch.loss_mask[0].nonzero().squeeze(1).tolist() == keep.tolist()
    ratio = torch.exp(logp[0, keep] - torch.tensor(-0.5))
    expected = -(ratio.clamp(max=1.2)).mean()
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("custom_generate_function_path", "no_such_module_xyz:gen", "cannot import"),
        ("custom_generate_function_path", f"{TOOLS}:tool", "must be callable as async def"),
        ("custom_generate_function_path", f"{TOOLS}:tool_async", "must be callable as async def"),
        ("generate_execute_tool_function_path", f"{TOOLS}:wrong_arity", "fn(name, arguments)"),
        ("generate_execute_tool_function_path", "tests/none.py:tool", "is not a file"),
        ("generate_tool_call_parser", "no_such_parser", "does not exist"),
        ("rollout_function_path", f"{TOOLS}:wrong_arity", "fn(ctx, rollout_id, data_source"),
    ],
)
def test_bad_user_functions_are_one_line(field, value, message):
    config = make_config(**{field: value})
    with pytest.raises(UserError, match=re.escape(message)) as info:
        load_user_functions(config.multiturn)
    assert "\n" not in str(info.value)


def test_tool_specs_must_be_json(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text("tools: [search]\n")
    config = make_config(generate_tool_specs_path=str(bad))
    with pytest.raises(UserError, match="is not JSON"):
        load_user_functions(config.multiturn)
    bad.write_text('{"name": "search"}')
    with pytest.raises(UserError, match="JSON list"):
        load_user_functions(config.multiturn)


def test_rewards_of_the_whole_sample_and_of_a_group(tmp_path):
    """--custom-rm-path as fn(sample), fn(config, sample) and (--group-rm) fn(config, samples),
    in training and in evaluation."""
    from mileage.rollout.data import EvalSet
    from mileage.rollout.evaluation import sample_answers
    from mileage.rollout.rewards import load_custom_reward, score_samples

    rm = tmp_path / "rm.py"
    rm.write_text(
        "def of_sample(sample):\n    return float(len(sample.response_ids))\n"
        "async def with_config(config, sample):\n    return float(sample.turns)\n"
        "def of_group(config, samples):\n"
        "    return [float(i) for i, _ in enumerate(samples)]\n"
    )
    config = make_config()
    agent, tok, encode = build_agent(config, reward=load_custom_reward(f"{rm}:of_sample"))
    try:
        samples = generate_samples(
            ScriptedEngine(tok), encode, PROMPTS[:2], PARAMS, 2, agent.reward_fn, 1, 0, agent
        )
        assert [s.reward for s in samples] == [float(len(s.response_ids)) for s in samples]
        turns = score_samples(load_custom_reward(f"{rm}:with_config"), samples, config, 2)
        assert turns == [2.0, 2.0, 1.0, 1.0]
        group = load_custom_reward(f"{rm}:of_group", group_rm=True)
        assert score_samples(group, samples, config, 2, group_rm=True) == [0.0, 1.0, 0.0, 1.0]
        evaluated = sample_answers(
            ScriptedEngine(tok),
            encode,
            EvalSet("e", PROMPTS[1:2]),
            PARAMS,
            2,
            agent.reward_fn,
            None,
            agent.score,
        )
        assert [s.reward for s in evaluated] == [2.0, 2.0]  # "4" and EOS
    finally:
        agent.close()


# a chat template in the char tokenizer's alphabet: u/a/t open user/assistant/tool messages,
# an assistant message ends with EOS and then "==" (as Qwen's ends with <|im_end|> and "\n")
TEMPLATE = (
    "{%- if tools -%}{{ tools | length }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}u{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'assistant' -%}a{{ m.content }}{{ eos_token }}=="
    "{%- elif m.role == 'tool' -%}t{{ m.content }}{{ eos_token }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}a{%- endif -%}"
)


def test_chat_prompts_tools_and_tool_messages_go_through_the_template():
    from mileage.rollout.multiturn import template_tool_ids
    from mileage.rollout.tool_parsers import ParsedCall

    tok = build_char_tokenizer(builtin_alphabet())
    tok.chat_template = TEMPLATE
    encode = PromptEncoder(tok, False)
    eos = tok.eos_token_id
    messages = [{"role": "user", "content": "12"}]
    chat = Prompt(0, "12", "x", messages=messages)
    # a message list always goes through the template, with the tool specs as tools=
    assert encode.prompt_ids(chat) == ids(tok, "u12") + [eos] + ids(tok, "a")
    tools = [{"type": "function", "function": {"name": "rev"}}] * 2
    assert encode.prompt_ids(chat, tools) == ids(tok, "2u12") + [eos] + ids(tok, "a")
    assert encode.prompt_ids(Prompt(1, "12", "x")) == tok("12")["input_ids"]  # plain text
    # the model's turn ends at EOS; what the template writes after it ("==") comes first
    turn = ids(tok, "13") + [eos]
    calls = [ParsedCall("rev", {"x": "13"}), ParsedCall("rev", {"x": "4"})]
    got = template_tool_ids(tok, ["31", "4"], calls, turn)
    assert got == ids(tok, "==t31") + [eos] + ids(tok, "t4") + [eos] + ids(tok, "a")
    # a template that rewrites the conversation before the tool messages is refused
    tok.chat_template = TEMPLATE.replace(
        "{%- for m in messages -%}", "{%- for m in messages[-1:] -%}"
    )
    with pytest.raises(UserError, match="append-only"):
        template_tool_ids(tok, ["31"], calls[:1], turn)


def test_a_taken_parser_name_is_refused_not_replaced():
    """A user module registering `calc` (the built-in task's format) must not silently change
    what runs using `--generate-tool-call-parser calc` parse; the same function again (a module
    imported twice) is fine."""
    from mileage.rollout import tool_parsers

    builtin = tool_parsers.PARSERS["calc"]
    with pytest.raises(UserError, match="'calc' is already registered"):
        tool_parsers.register_parser("calc", lambda text: [])
    assert tool_parsers.PARSERS["calc"] is builtin
    tool_parsers.register_parser("calc", builtin.parse, builtin.render)
    assert tool_parsers.PARSERS["calc"].parse is builtin.parse


def test_a_damaged_journal_line_is_refused_a_torn_last_line_is_not(tmp_path):
    """Each journal line carries a checksum: a changed byte in a written entry stops the run in
    one line naming the file and line (a resume would otherwise hand a trajectory a tool output
    nobody got); a last line cut by a kill is left out and its call made again."""
    from mileage.rollout.journal import ToolJournal

    journal = ToolJournal(tmp_path)
    journal.record(3, "3/0/0/0/0", "rev", {"x": "12"}, "ok", "21")
    journal.record(3, "3/0/1/0/0", "rev", {"x": "34"}, "ok", "43")
    path = tmp_path / "slot_3.jsonl"
    intact = path.read_bytes()
    ToolJournal(tmp_path).check()

    path.write_bytes(intact.replace(b'"21"', b'"31"', 1))  # still JSON, another answer
    with pytest.raises(UserError, match=r"slot_3\.jsonl is damaged at line 1 "):
        ToolJournal(tmp_path).check()

    path.write_bytes(intact[: len(intact) - 9])  # the second line torn by a kill
    again = ToolJournal(tmp_path)
    again.check()
    assert again.lookup(3, "3/0/0/0/0", "rev", {"x": "12"}) == ("ok", "21")
    assert again.lookup(3, "3/0/1/0/0", "rev", {"x": "34"}) is None  # called again

    # a journal written before lines had checksums still replays
    path.write_text('{"arguments": {"x": "12"}, "key": "3/0/0/0/0", "name": "rev", '
                    '"output": "21", "status": "ok"}\n')  # fmt: skip
    assert ToolJournal(tmp_path).lookup(3, "3/0/0/0/0", "rev", {"x": "12"}) == ("ok", "21")
