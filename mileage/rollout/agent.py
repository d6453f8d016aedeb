"""How a run turns prompts into scored samples: single-turn, a user generate function, or the
built-in tool loop; and, with `--rollout-function-path`, the user's whole rollout.

`Agent` is built once per run (after preflight loaded and checked every user function) and is
what both loops call through `mileage.rollout.rollout.generate_samples`; neither loop learns
which engine or which generate function it has.
"""

from __future__ import annotations

import copy
import functools
import json
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mileage.errors import UserError
from mileage.rollout.agents.endpoint import AgentEndpoint
from mileage.rollout.agents.session import AgentLimits, AgentRollout, load_agent
from mileage.rollout.agents.trajectory import Renderer
from mileage.rollout.client import TokenClient, TurnBatcher
from mileage.rollout.engines.base import Engine, SamplingParams
from mileage.rollout.journal import ToolJournal
from mileage.rollout.multiturn import GenerateContext, MultiTurnConfig, tool_loop
from mileage.rollout.prompts import Prompt
from mileage.rollout.rewards import RewardFn, score_samples
from mileage.rollout.rewards.journaled import ScoreOnce, in_place, scored_once
from mileage.rollout.sample import Sample
from mileage.rollout.tool_parsers import ToolFormat, tool_format
from mileage.rollout.toolpool import ToolPool
from mileage.rollout.userfn import (
    DEFAULT_HOOK_TIMEOUT,
    Clock,
    Hook,
    HookCalls,
    load_function,
    require_signature,
)

GENERATE_SHAPE = "async def generate(ctx, sample, params) -> Sample"
# the multi-turn length limit when neither --rollout-max-context-len nor the model's config
# gives one
DEFAULT_CONTEXT = 32768
ROLLOUT_SHAPE = "fn(ctx, rollout_id, data_source, evaluation=False) -> list[Sample]"
GENERATE_FLAG = "--custom-generate-function-path"
ROLLOUT_FLAG = "--rollout-function-path"


def load_tool_specs(path: str) -> list[dict[str, Any]]:
    """--generate-tool-specs-path: a JSON list of tool specs (dicts)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--generate-tool-specs-path: {path} does not exist")
    try:
        specs = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--generate-tool-specs-path: {path} is not JSON ({exc})") from None
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise UserError(f"--generate-tool-specs-path: {path} must hold a JSON list of tool specs")
    return specs


@dataclass
class UserFunctions:
    """The multi-turn user code, loaded and checked in preflight (before anything is written)."""

    generate: Callable | None = None  # --custom-generate-function-path, or the tool loop
    agent: Callable | None = None  # --agent-function-path (mileage.rollout.agents)
    rollout: Callable | None = None  # --rollout-function-path
    tool_specs: list[dict[str, Any]] | None = None
    tool_format: ToolFormat | None = None
    hook_timeout: float = field(default=DEFAULT_HOOK_TIMEOUT)  # --hook-timeout


def load_user_functions(
    cfg: MultiTurnConfig, hook_timeout: float = DEFAULT_HOOK_TIMEOUT
) -> UserFunctions:
    """Every multi-turn flag checked: importable paths, signatures, JSON, parser names."""
    cfg.validate()
    out = UserFunctions(hook_timeout=hook_timeout)
    if cfg.custom_generate_function_path:
        flag = GENERATE_FLAG
        out.generate = load_function(cfg.custom_generate_function_path, flag)
        require_signature(out.generate, flag, 3, GENERATE_SHAPE, coroutine=True)
    elif cfg.generate_execute_tool_function_path:
        out.generate = tool_loop
    if cfg.agent_function_path:
        out.agent = load_agent(cfg.agent_function_path)
    if cfg.generate_execute_tool_function_path:
        flag = "--generate-execute-tool-function-path"
        tool = load_function(cfg.generate_execute_tool_function_path, flag)
        require_signature(tool, flag, 2, "fn(name, arguments) -> str")
    if cfg.rollout_function_path:
        flag = ROLLOUT_FLAG
        out.rollout = load_function(cfg.rollout_function_path, flag)
        require_signature(out.rollout, flag, 3, ROLLOUT_SHAPE)
    if cfg.generate_tool_specs_path:
        out.tool_specs = load_tool_specs(cfg.generate_tool_specs_path)
    # after the user's modules are imported: one of them may register its parser
    out.tool_format = tool_format(cfg.generate_tool_call_parser)
    return out


class Agent:
    """Generates and scores one rollout's samples (module docstring)."""

    def __init__(
        self,
        config: Any,
        user: UserFunctions,
        tokenizer: Any,
        encode: Callable,
        reward_fn: RewardFn,
        journal: ToolJournal | str | Path | None,
        context_len: int,
        vocab_size: int | None = None,
    ):
        self.config = config
        # the ids a generate function may return: the model's embedding rows (its config's
        # vocab_size), else the tokenizer's (None: unknown, unchecked)
        self.vocab_size = vocab_size or _tokenizer_size(tokenizer)
        self.cfg: MultiTurnConfig = config.multiturn
        self.user = user
        self.tokenizer = tokenizer
        self.encode = encode
        self.reward_fn = reward_fn
        self.group_rm = config.reward.group_rm
        self.context_len = self.cfg.rollout_max_context_len or context_len
        # a directory (or None: in memory) or the run's journal, which its checkpoint writer
        # prunes after each commit
        self.journal = journal if isinstance(journal, ToolJournal) else ToolJournal(journal)
        path = self.cfg.generate_execute_tool_function_path
        self.pool = ToolPool(path, self.cfg.tool_timeout, self.cfg.tool_workers) if path else None
        # the agents' OpenAI-compatible endpoint, started by the first agent rollout
        self.endpoint = AgentEndpoint() if user.agent is not None else None
        # a journaled reward's scoring, once for all ranks (set by the run under torchrun)
        self.score_once: ScoreOnce = in_place

    @property
    def multi_turn(self) -> bool:
        return self.user.generate is not None or self.user.agent is not None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.endpoint is not None:
            self.endpoint.close()

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        tools = prompt.tools if prompt.tools is not None else self.user.tool_specs
        return self.encode.prompt_ids(prompt, tools)

    def generate(
        self,
        engine: Engine,
        prompts: list[Prompt],
        params: SamplingParams,
        n_samples: int,
        seed: int,
        rollout_id: int,
        single_turn: Callable[[], list[Sample]],
    ) -> list[Sample]:
        """`n_samples` scored samples per prompt, those of one prompt contiguous;
        `single_turn()` generates them the single-turn way when no generate function is set."""
        if not self.multi_turn:
            samples = single_turn()
        elif self.user.agent is not None:
            samples = self._generate_agents(engine, prompts, params, n_samples, seed, rollout_id)
        else:
            samples = self._generate_multi_turn(
                engine, prompts, params, n_samples, seed, rollout_id
            )
        self.score(samples, n_samples, rollout_id)
        return samples

    def score(self, samples: list[Sample], group_size: int, slot: int | None = None) -> None:
        """Each sample's reward: an agent's own (or 0 for a failed agent), else the run's; a
        reward that may answer differently when asked again is journaled in round `slot`'s file
        (`rewards.journaled`; evaluation passes no slot) and computed once (`score_once`)."""
        given = [(s.reward, s.agent_stats) for s in samples]
        rewards = scored_once(
            self.reward_fn,
            lambda: score_samples(self.reward_fn, samples, self.config, group_size, self.group_rm),
            self.journal,
            slot,
            samples,
            self.score_once,
        )
        for sample, reward, (own, stats) in zip(samples, rewards, given, strict=True):
            agent_set = stats is not None and (stats["own_reward"] or sample.agent_failure)
            sample.reward = own if agent_set else reward

    def _generate_agents(self, engine, prompts, params, n_samples, seed, rollout_id):
        """--agent-function-path: one black-box agent per sample against the endpoint."""
        assert self.endpoint is not None and self.user.agent is not None and self.user.tool_format
        inputs, labels, rows = [], [], []
        for position, prompt in enumerate(prompts):
            ids = self.prompt_ids(prompt)
            for index in range(n_samples):
                inputs.append(
                    Sample(prompt, list(ids), [], [], "", 0.0, False, engine.weight_version)
                )
                labels.append(f"sample {position * n_samples + index} (prompt {prompt.index})")
                rows.append((position, index))
        limits = AgentLimits(
            self.cfg.agent_timeout, self.cfg.agent_max_concurrency, self.context_len,
            self.vocab_size,
        )  # fmt: skip
        rollout = AgentRollout(
            self.user.agent, self.endpoint, Renderer(self.tokenizer, self.user.tool_format),
            engine, params, seed, rollout_id, self.journal, limits,
        )  # fmt: skip
        return rollout.run(inputs, labels, rows)

    def _generate_multi_turn(self, engine, prompts, params, n_samples, seed, rollout_id):
        batcher = TurnBatcher(engine)
        labels = [
            f"sample {p * n_samples + i} (prompt {prompt.index})"
            for p, prompt in enumerate(prompts)
            for i in range(n_samples)
        ]
        hook = Hook("generate function", GENERATE_FLAG, self.user.hook_timeout)
        calls = HookCalls(hook, labels)
        user_code = self.user.generate is not tool_loop
        coroutines, inputs = [], []
        for position, prompt in enumerate(prompts):
            ids = self.prompt_ids(prompt)
            for index in range(n_samples):
                row = position * n_samples + index
                clock = calls.clocks[row] if user_code else None
                ctx = self._context(
                    batcher, params, seed, rollout_id, position, index, row, prompt, clock
                )
                sample = Sample(
                    prompt, list(ids), [], [], "", 0.0, False, engine.weight_version, [], []
                )
                inputs.append(sample)
                coroutines.append(self.user.generate(ctx, copy.deepcopy(sample), params))
        if user_code:  # behind the hook boundary: bounded, named when it fails
            results = calls.run(
                lambda c: batcher.run([c.acall(i, co) for i, co in enumerate(coroutines)])
            )
        else:  # the built-in tool loop: the run's own code, its tool calls bounded on their own
            results = batcher.run(coroutines)
        return [
            self._checked(r, s, label) for r, s, label in zip(results, inputs, labels, strict=True)
        ]

    def _context(self, batcher, params, seed, slot, position, index, row, prompt, clock):
        """The generate context of sample `index` of the prompt at `position` in slot `slot`
        (its client seeds each call by these and the call's number; `row` orders its requests
        in the batcher's engine calls)."""
        purpose = f"rollout/{slot}/{position}/{index}"
        client = _TimedClient(batcher, params, (seed, purpose), row, clock)
        tools = prompt.tools if prompt.tools is not None else self.user.tool_specs
        return GenerateContext(
            client, self.tokenizer, self.config, slot, position, index, tools, self.context_len,
            self.user.tool_format, self.encode.uses_template(prompt), _pool=self.pool,
            _journal=self.journal, _clock=clock,
        )  # fmt: skip

    def continue_tool_loop(
        self, engine: Engine, samples: list[Sample], params: SamplingParams, budget: int,
        seed: int, slot: int, n: int,
    ) -> list[Sample]:  # fmt: skip
        """--partial-rollout: each unfinished trajectory (sample i of the round's group i // n,
        groups of `n`) advanced by the built-in tool loop by at most `budget` model tokens,
        seeded by `slot`; a sample with a stop reason comes back as it was. New samples, not
        yet scored."""
        batcher = TurnBatcher(engine)
        rows = [i for i, s in enumerate(samples) if s.stop_reason is None]
        coroutines = [
            tool_loop(
                self._context(
                    batcher, params, seed, slot, i // n, i % n, i, samples[i].prompt, None
                ),
                copy.deepcopy(samples[i]),
                params,
                budget,
            )  # fmt: skip
            for i in rows
        ]
        out = list(samples)
        for i, sample in zip(rows, batcher.run(coroutines), strict=True):
            out[i] = sample
        return out

    def _checked(self, result: Any, given: Sample, label: str) -> Sample:
        """The generate function's return checked against its contract (mileage.rollout.userfn);
        a `response` left empty is decoded from the response ids, as the reward reads it."""
        flag = GENERATE_FLAG
        if isinstance(result, list):
            if len(result) != 1:
                raise UserError(
                    f"{flag}: the generate function returned {len(result)} samples for {label}; "
                    "mileage trains groups of --n-samples-per-prompt samples, one per call"
                )
            result = result[0]
        if not isinstance(result, Sample):
            raise UserError(
                f"{flag}: the generate function returned {type(result).__name__} for {label}; "
                "expected a Sample"
            )
        if result.prompt.index != given.prompt.index or result.prompt_ids != given.prompt_ids:
            raise UserError(f"{flag}: the generate function changed the prompt of {label}")
        try:
            result.check()
        except ValueError as exc:
            raise UserError(
                f"{flag}: the sample it returned for {label} is inconsistent: {exc}"
            ) from None
        vocab = self.vocab_size or 2**63
        bad = [
            t
            for t in result.response_ids
            if not (isinstance(t, numbers.Integral) and 0 <= t < vocab)
        ]
        if bad:
            raise UserError(
                f"{flag}: the generate function returned response id {bad[0]!r} for {label}; "
                f"expected token ids from 0 to {vocab - 1} (the model's vocabulary)"
            )
        if not result.response and result.response_ids:
            result.response = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
        return result

    def run_rollout(self, engine: Engine, rollout_id: int, data_source: Any, generate: Callable):
        """--rollout-function-path: the user's whole rollout; `generate(prompts)` is the run's
        own generation (what the rollout would do without the function)."""
        hook = Hook("rollout function", ROLLOUT_FLAG, self.user.hook_timeout)
        calls = HookCalls(hook, [f"rollout {rollout_id}"])
        ctx = RolloutContext(self.config, self.tokenizer, engine, self, generate, calls.clocks[0])
        fn = functools.partial(self.user.rollout, evaluation=False)
        samples = calls.run(lambda c: c.call(0, fn, ctx, rollout_id, data_source))
        n = self.config.rollout.n_samples_per_prompt
        expected = self.config.rollout.rollout_batch_size * n
        flag = ROLLOUT_FLAG
        if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
            raise UserError(f"{flag}: the rollout function must return a list of Samples")
        if len(samples) != expected:
            raise UserError(
                f"{flag}: the rollout function returned {len(samples)} samples; the run trains "
                f"--rollout-batch-size x --n-samples-per-prompt = {expected}"
            )
        for start in range(0, expected, n):
            if len({s.prompt.index for s in samples[start : start + n]}) != 1:
                raise UserError(f"{flag}: each prompt's {n} samples must be contiguous")
        for s in samples:
            try:
                s.check()
            except ValueError as exc:
                raise UserError(f"{flag}: a returned sample is inconsistent: {exc}") from None
        return samples


class _TimedClient(TokenClient):
    """The sample's client, its waits on the engine off the generate function's clock."""

    def __init__(self, batcher, params, seed_key, sample, clock: Clock | None):
        super().__init__(batcher, params, seed_key, sample)
        self._clock = clock

    async def generate(self, input_ids: list[int], max_new_tokens: int | None = None):
        if self._clock is None:
            return await super().generate(input_ids, max_new_tokens)
        with self._clock.waiting_on_the_run():
            return await super().generate(input_ids, max_new_tokens)


def _tokenizer_size(tokenizer: Any) -> int | None:
    """The tokenizer's id count (added tokens too), or None when it does not say."""
    try:
        return len(tokenizer)
    except TypeError:
        return getattr(tokenizer, "vocab_size", None)


@dataclass
class RolloutContext:
    """What a --rollout-function-path function gets (besides rollout_id and the data source)."""

    config: Any  # the RunConfig
    tokenizer: Any
    engine: Engine  # token ids in, completions out (engine.generate)
    agent: Agent
    _generate: Callable[[list[Prompt]], list[Sample]]  # the run's own generation and scoring
    # the rollout function's clock (--hook-timeout): the run's generation and scoring are off it
    _clock: Clock = field(default_factory=Clock, repr=False)

    def generate(self, prompts: list[Prompt]) -> list[Sample]:
        """The run's own generation and scoring of `prompts`."""
        with self._clock.waiting_on_the_run():
            return self._generate(prompts)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.agent.prompt_ids(prompt)

    def score(self, samples: list[Sample]) -> None:
        """Set each sample's reward with the run's reward (groups of --n-samples-per-prompt)."""
        with self._clock.waiting_on_the_run():
            self.agent.score(samples, self.config.rollout.n_samples_per_prompt)
