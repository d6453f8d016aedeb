"""Multi-turn, tool-using generation: the flags, the per-sample context a generate function gets,
and the built-in tool loop (miles' `generate_hub/multi_turn.py` meaning).

The interface (docs/multiturn.md):

    async def generate(ctx: GenerateContext, sample: Sample, params: SamplingParams)
        -> Sample | list[Sample]

`sample` arrives with its prompt and `prompt_ids` (chat template applied, with the tool specs as
`tools=`) and an empty response. The function samples with `await ctx.client.generate(ids)`
(token ids in, token ids and log-probs out), calls tools with `await ctx.call_tool(...)` (run in
a killable worker, journaled for exact resume), and fills `response_ids`, `logprobs`,
`loss_mask`, `weight_versions` and the turn record. The built-in `tool_loop` below is one such
function: sample a turn, parse its tool calls, run them, append their outputs' ids (mask 0),
repeat until the model answers without a call, a limit is reached, or a tool fails.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.client import TokenClient
from mileage.rollout.engines.base import SamplingParams
from mileage.rollout.journal import ToolJournal, call_key
from mileage.rollout.sample import (
    LENGTH,
    MAX_TURNS,
    STOP,
    TOOL_ERROR,
    Sample,
    ToolCall,
)
from mileage.rollout.tool_parsers import DEFAULT_PARSER, ToolCallError, ToolFormat
from mileage.rollout.toolpool import ToolPool
from mileage.rollout.toolworker import OK
from mileage.rollout.userfn import Clock


@dataclass
class MultiTurnConfig:
    custom_generate_function_path: str | None = option(
        None,
        "generate each sample with async fn(ctx, sample, params) -> Sample (module.path:fn or "
        "path/to/file.py:fn; docs/multiturn.md): multi-turn and tool-using rollouts",
    )
    rollout_function_path: str | None = option(
        None,
        "the whole rollout: fn(ctx, rollout_id, data_source, evaluation=False) -> list[Sample] "
        "(miles' meaning; docs/multiturn.md)",
    )
    generate_max_turns: int = option(
        16, "built-in tool loop: model turns per trajectory at most (miles' meaning)"
    )
    generate_tool_specs_path: str | None = option(
        None,
        "JSON file: the list of tool specs (OpenAI function format) given to the chat template "
        "as tools= for every prompt without its own (--tool-key)",
    )
    generate_execute_tool_function_path: str | None = option(
        None,
        "the tool: fn(name, arguments) -> str, sync or async (module.path:fn or "
        "path/to/file.py:fn); giving it turns on the built-in tool loop",
    )
    generate_tool_call_parser: str = option(
        DEFAULT_PARSER,
        "how tool calls are read from the model's text (mileage.rollout.tool_parsers.PARSERS; "
        "qwen25/qwen/hermes: <tool_call>{json}</tool_call>)",
    )
    tool_timeout: float = option(
        60.0,
        "seconds one tool call may run; past it its worker process is killed and the "
        "trajectory ends with reason tool_timeout (the run goes on)",
    )
    tool_workers: int = option(4, "tool calls run at once, each in its own worker process")
    agent_function_path: str | None = option(
        None,
        "a black-box agent per sample: async def agent(base_url, api_key, sample) -> reward or "
        "None, written against the OpenAI API; its calls generate on the run's engine and are "
        "trained token for token (module.path:fn or path/to/file.py:fn; docs/agents.md)",
    )
    agent_max_concurrency: int | None = option(
        None, "agents running at once at most (default: every sample of the rollout)"
    )
    agent_timeout: float = option(
        600.0,
        "seconds of its own one agent may run per sample (waits on the endpoint do not count); "
        "past it the agent is cancelled and its sample ends with reason agent_timeout",
    )
    rollout_max_context_len: int | None = option(
        None,
        "multi-turn: prompt + whole response (model and tool tokens) at most this many tokens "
        "(miles' meaning; default: the model's context length)",
    )

    @property
    def multi_turn(self) -> bool:
        return bool(
            self.custom_generate_function_path
            or self.generate_execute_tool_function_path
            or self.agent_function_path
        )

    def validate(self) -> None:
        if self.generate_max_turns <= 0:
            raise UserError(f"--generate-max-turns must be positive, got {self.generate_max_turns}")
        if self.tool_timeout <= 0 or self.tool_workers <= 0:
            raise UserError("--tool-timeout and --tool-workers must be positive")
        if self.tool_timeout > threading.TIMEOUT_MAX:  # a wait past it raises OverflowError
            raise UserError(
                f"--tool-timeout must be at most {threading.TIMEOUT_MAX:g} seconds (the longest "
                f"wait Python can make), got {self.tool_timeout:g}"
            )
        if self.rollout_max_context_len is not None and self.rollout_max_context_len <= 0:
            raise UserError("--rollout-max-context-len must be positive")
        if self.agent_timeout <= 0 or self.agent_timeout > threading.TIMEOUT_MAX:
            raise UserError(
                f"--agent-timeout must be positive and at most {threading.TIMEOUT_MAX:g} seconds, "
                f"got {self.agent_timeout:g}"
            )
        if self.agent_max_concurrency is not None and self.agent_max_concurrency <= 0:
            raise UserError("--agent-max-concurrency must be positive")
        if self.agent_function_path:
            for flag, value in (
                ("--custom-generate-function-path", self.custom_generate_function_path),
                ("--rollout-function-path", self.rollout_function_path),
                ("--generate-execute-tool-function-path", self.generate_execute_tool_function_path),
            ):
                if value:
                    raise UserError(
                        f"--agent-function-path and {flag} both say how samples are generated; "
                        "the agent calls its own tools (docs/agents.md): give one"
                    )
        if self.custom_generate_function_path and self.rollout_function_path:
            raise UserError(
                "--custom-generate-function-path and --rollout-function-path both replace how "
                "samples are generated; give one (a rollout function may call ctx.generate)"
            )


@dataclass(frozen=True)
class ToolResult:
    status: str  # "ok", "tool_error" or "tool_timeout"
    output: str  # the tool's text, or the failure's one-line description


@dataclass
class GenerateContext:
    """What a generate function gets besides its sample and sampling parameters."""

    client: TokenClient  # async token-in/token-out sampling over the run's engine
    tokenizer: Any
    config: Any  # the run's RunConfig (every flag, by section: config.rollout, config.data, ...)
    rollout_id: int  # the generation slot (the rollout id in `mileage train`)
    prompt_position: int  # the prompt's position in the rollout
    sample_index: int  # the sample's index within its prompt's group
    tools: list[dict[str, Any]] | None  # the prompt's tool specs (its own, or the specs file's)
    max_context_len: int  # prompt + response may not exceed this many tokens
    tool_format: ToolFormat  # --generate-tool-call-parser's parse and plain-text render
    chat_template: bool  # the prompt went through the chat template (tool outputs will too)
    _pool: ToolPool | None = field(default=None, repr=False)
    _journal: ToolJournal | None = field(default=None, repr=False)
    _calls_in_turn: dict[int, int] = field(default_factory=dict, repr=False)
    # the generate function's clock (--hook-timeout): tool calls are bounded by --tool-timeout
    _clock: Clock | None = field(default=None, repr=False)

    def seed(self, call: int) -> int:
        """The seed the sample's client call number `call` samples with (keyed on run seed,
        rollout id, prompt position, sample index and call)."""
        return self.client.seed_of(call)

    async def call_tool(self, name: str, arguments: dict[str, Any], turn: int) -> ToolResult:
        """Run the tool (--generate-execute-tool-function-path) in a worker process, or take its
        recorded outcome from the tool journal when an interrupted run already made this call."""
        if self._pool is None or self._journal is None:
            raise RuntimeError("call_tool needs --generate-execute-tool-function-path")
        number = self._calls_in_turn.get(turn, 0)
        self._calls_in_turn[turn] = number + 1
        key = call_key(self.rollout_id, self.prompt_position, self.sample_index, turn, number)
        recorded = self._journal.lookup(self.rollout_id, key, name, arguments)
        if recorded is not None:
            return ToolResult(*recorded)
        if self._clock is None:
            status, output = await self._pool.call(name, arguments)
        else:
            with self._clock.waiting_on_the_run():
                status, output = await self._pool.call(name, arguments)
        self._journal.record(self.rollout_id, key, name, arguments, status, output)
        return ToolResult(status, output)

    def tool_output_ids(
        self, outputs: list[str], calls: list[Any], last_ids: list[int]
    ) -> list[int]:
        """The ids that follow a model turn whose `calls` returned `outputs`: tool messages
        through the chat template (then the next assistant header), or the parser's plain text."""
        if not (self.chat_template and getattr(self.tokenizer, "chat_template", None)):
            text = self.tool_format.render(outputs)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return template_tool_ids(self.tokenizer, outputs, calls, last_ids)


def template_tool_ids(
    tokenizer, outputs: list[str], calls: list[Any], last_ids: list[int]
) -> list[int]:
    """Tool messages rendered by the chat template, as the ids to append after the model's turn.

    Rendered after a stand-in conversation and cut at its end (the template must render the
    stand-in as a prefix of stand-in + tool messages: append-only). Templates end an assistant
    message with its end token and then more (Qwen: `<|im_end|>\\n`); the model's turn stops at
    the end token, so what the template puts after it is appended here too.
    """
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ],
    }
    base = [{"role": "user", "content": "x"}, assistant]
    tool_messages = [
        {"role": "tool", "tool_call_id": f"call_{i}", "name": c.name, "content": out}
        for i, (c, out) in enumerate(zip(calls, outputs, strict=True))
    ]
    ids = appended_ids(tokenizer, base, tool_messages, last_ids)
    if ids is None:
        raise UserError(
            "the chat template does not render tool messages append-only (the conversation "
            "before them changes); mileage never re-tokenizes a trajectory, so it cannot use it"
        )
    return ids


def appended_ids(
    tokenizer,
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    last_ids: list[int],
    tools: list[dict[str, Any]] | None = None,
) -> list[int] | None:
    """The ids the chat template puts after `history` (ending with the model's turn, whose ids
    end with `last_ids`) when `new` messages follow, up to the next assistant header; None when
    the template does not render history + new with history's rendering as a prefix."""
    extra = {"tools": tools} if tools else {}
    render = tokenizer.apply_chat_template
    without = list(
        render(history, tokenize=True, add_generation_prompt=False, return_dict=False, **extra)
    )
    with_new = list(
        render(history + new, tokenize=True, add_generation_prompt=True, return_dict=False, **extra)
    )
    if with_new[: len(without)] != without:
        return None
    tail: list[int] = []
    if last_ids and last_ids[-1] in without:
        end = len(without) - 1 - without[::-1].index(last_ids[-1])
        tail = without[end + 1 :]
    return tail + with_new[len(without) :]


async def tool_loop(
    ctx: GenerateContext, sample: Sample, params: SamplingParams, budget: int | None = None
) -> Sample:
    """The built-in multi-turn tool loop (module docstring).

    With a `budget` (--partial-rollout) the loop samples at most that many model tokens in this
    call and may start from a trajectory an earlier call left unfinished: a turn the budget
    cuts stays open (`Sample.open_turn`) and is continued, then parsed whole, by the next call;
    a trajectory still going when the budget is spent has no `stop_reason` yet. Without one it
    runs the whole trajectory from the prompt."""
    max_turns = ctx.config.multiturn.generate_max_turns
    decode = ctx.tokenizer.decode
    response = list(sample.response_ids)
    context = list(sample.prompt_ids) + response
    mask = list(sample.mask())
    logprobs = list(sample.logprobs)
    versions = list(sample.weight_versions or [])
    calls_made = list(sample.tool_calls)
    open_ids = response[len(response) - sample.open_turn :] if sample.open_turn else []
    # the turn to sample next: the open one, else the one after the turns taken
    turns = sample.turns if response else 0
    turn = turns - 1 if open_ids else turns
    stop: str | None = None
    while budget is None or budget > 0:
        room = ctx.max_context_len - len(context)
        if room <= 0:
            stop = LENGTH
            break
        cap = min(params.max_new_tokens - len(open_ids), room)
        cut = budget is not None and budget < cap  # the round's budget binds, not the turn's
        out = await ctx.client.generate(context, min(cap, budget) if cut else cap)
        turns = turn + 1
        if budget is not None:
            budget -= len(out.ids)
        context += out.ids
        response += out.ids
        mask += [1] * len(out.ids)
        logprobs += out.logprobs
        versions += [out.weight_version] * len(out.ids)
        turn_ids, open_ids = open_ids + out.ids, []
        if out.finish_reason == "length":
            if cut:  # continued by the next round: the turn is not over
                open_ids = turn_ids
                break
            stop = LENGTH
            break
        try:
            calls = ctx.tool_format.parse(decode(turn_ids, skip_special_tokens=True))
        except ToolCallError as exc:
            calls_made.append(ToolCall(turn, "", {}, TOOL_ERROR, str(exc)))
            stop = TOOL_ERROR
            break
        if not calls:
            stop = STOP
            break
        if turn == max_turns - 1:
            stop = MAX_TURNS  # the last turn still calls a tool: no turn is left to read it
            break
        outputs = []
        for call in calls:
            result = await ctx.call_tool(call.name, call.arguments, turn)
            calls_made.append(
                ToolCall(turn, call.name, call.arguments, result.status, result.output)
            )
            if result.status != OK:
                stop = result.status
                break
            outputs.append(result.output)
        if stop is not None:
            break
        tool_ids = ctx.tool_output_ids(outputs, calls, turn_ids)
        if len(context) + len(tool_ids) >= ctx.max_context_len:
            stop = LENGTH  # no room for the tool's answer and another turn
            break
        calls_made[-1].output_ids = tool_ids
        context += tool_ids
        response += tool_ids
        mask += [0] * len(tool_ids)
        logprobs += [0.0] * len(tool_ids)
        versions += [out.weight_version] * len(tool_ids)
        turn += 1
    sample.response_ids = response
    sample.logprobs = logprobs
    sample.loss_mask = mask
    sample.weight_versions = versions
    sample.weight_version = versions[0] if versions else sample.weight_version
    sample.response = decode(response, skip_special_tokens=True)
    sample.tool_calls = calls_made
    sample.turns = turns
    sample.stop_reason = stop
    sample.open_turn = len(open_ids)
    sample.finished = stop is not None and stop != LENGTH
    return sample
