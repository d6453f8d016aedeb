"""One rollout of black-box agents: each sample's agent runs against the endpoint, every
completion it gets is the engine's, batched turn-synchronously, journaled, and recorded into
the sample's trajectory.

The agent is the user's function (`--agent-function-path`), `async def agent(base_url,
api_key, sample) -> reward or None` (a plain `def` runs in a thread). It talks to
`base_url` with any OpenAI client. Its sample trains the ids the engine produced for it
(`trajectory`), with the reward it returns, or the run's reward of the trajectory's text.

Exactness. Every engine call of a rollout batches the requests of all live agents, in sample
order, once each of them is waiting on the endpoint or finished (`client.TurnBatcher`), and
samples each row with a seed keyed on (run seed, slot, prompt, sample, call): nothing depends
on which agent was faster. Each engine call's completions are journaled in one fsynced line
(`journal.record_batch`) before any agent sees them. A rerun of the rollout (after a kill)
runs the agents again: a request equal to the journaled one gets the journaled completion, so
an agent that is deterministic given its inputs lands on the same trajectory. A request that
differs (the agent is not deterministic) is a divergence: said once, and that sample samples
afresh from there on, never from the journal again.

Failures are the sample's, not the run's: an agent that raises, runs past `--agent-timeout`
seconds of its own (waits on the endpoint do not count), returns something other than a
number or None, or never calls the endpoint ends its sample with a stop reason naming it (its
reward 0, nothing of it trained) and a line on stderr; the rollout goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hashlib
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.agents.answers import judge, make_answer, where
from mileage.rollout.agents.endpoint import AgentEndpoint
from mileage.rollout.agents.protocol import Answer, ApiError, Request
from mileage.rollout.agents.trajectory import Candidate, Renderer, RenderError, Trajectory
from mileage.rollout.client import TurnBatcher, _Request
from mileage.rollout.engines.base import ROW_SEED_MASK, Completion, Engine, SamplingParams
from mileage.rollout.journal import ToolJournal
from mileage.rollout.sample import (
    AGENT_ERROR,
    AGENT_TIMEOUT,
    LENGTH,
    STOP,
    Sample,
)
from mileage.rollout.userfn import Clock, load_function, require_signature
from mileage.seeding import derive_seed

AGENT_FLAG = "--agent-function-path"
AGENT_SHAPE = "async def agent(base_url, api_key, sample) -> float | None"
# an async agent that does not stop this long after it was cancelled blocks the event loop
CANCEL_GRACE_S = 10.0
SHOWN_FAILURES = 3  # failed samples named on stderr per rollout (all are in the metrics)


def load_agent(path: str) -> Callable:
    """The agent function `path` names, checked (one line, exit 2, when it does not load)."""
    fn = load_function(path, AGENT_FLAG)
    require_signature(fn, AGENT_FLAG, 3, AGENT_SHAPE)
    return fn


@dataclass(frozen=True)
class AgentLimits:
    timeout: float  # --agent-timeout: seconds of the agent's own per sample
    max_concurrency: int | None  # --agent-max-concurrency (None: every sample at once)
    context_len: int  # prompt + whole response of a segment at most
    vocab_size: int | None


def _digest(ids: list[int], params: SamplingParams, seed: int | None) -> str:
    body = json.dumps([ids, params.max_new_tokens, params.temperature, params.top_p, seed])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class _Row:
    """One sample's state: its trajectory, clock and key. The agent's coroutine (event loop)
    and the endpoint's handler threads share it; `flag` guards `ended` and the trajectory's
    commits and is never held across a wait, `serial` keeps one request of the sample at a
    time (held while its answer is generated)."""

    def __init__(self, renderer: Renderer, position: int, index: int, label: str):
        self.traj = Trajectory(renderer)
        self.position, self.index, self.label = position, index, label
        self.clock = Clock()
        self.flag = threading.Lock()
        self.serial = threading.Lock()
        self.ended = False
        self.diverged = False
        self.timed_out = False
        self.cancelled_at = 0.0
        self.task: asyncio.Future | None = None
        self.key = ""
        self.base_url = ""
        self.tool_calls = 0


class AgentRollout:
    """The agents of one rollout's samples (module docstring)."""

    def __init__(
        self,
        fn: Callable,
        endpoint: AgentEndpoint,
        renderer: Renderer,
        engine: Engine,
        params: SamplingParams,
        seed: int,
        slot: int,
        journal: ToolJournal,
        limits: AgentLimits,
    ):
        self.fn, self.endpoint, self.renderer = fn, endpoint, renderer
        self.params, self.seed, self.slot = params, seed, slot
        self.journal, self.limits = journal, limits
        self.batcher = TurnBatcher(engine, on_batch=self._journal_batch)
        self.rows: list[_Row] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.failure: BaseException | None = None  # the engine's: the run's, not a sample's
        self.replayed = 0
        self.diverged_labels: list[str] = []

    # --- the endpoint side (handler threads) --------------------------------------------------

    def sample_handler(self, row: int) -> _SampleHandle:
        return _SampleHandle(self, row)

    def handle(self, row: int, request: Request) -> tuple[list[Answer], list[int]]:
        state = self.rows[row]
        with state.clock.waiting_on_the_run(), state.serial:
            with state.flag:
                if state.ended:
                    raise ApiError("this sample's agent has ended; its key is closed", 409)
            if self.failure is not None:
                raise ApiError(f"the run's engine failed: {self.failure}", 503)
            try:
                if request.chat:
                    plan = state.traj.plan_chat(request.messages or [], request.tools)
                else:
                    plan = state.traj.plan_text(request.prompt or "")
            except RenderError as exc:
                raise ApiError(str(exc), param="messages") from None
            ids = plan.input_ids
            vocab = self.limits.vocab_size
            if vocab is not None and any(t >= vocab for t in ids):
                raise ApiError(f"prompt: a token id is outside the vocabulary (0..{vocab - 1})")
            room = self.limits.context_len - len(ids)
            if room <= 0:
                raise ApiError(
                    f"the conversation is {len(ids)} tokens; the run's context limit is "
                    f"{self.limits.context_len} (--rollout-max-context-len or the model's)",
                    param="messages" if request.chat else "prompt",
                )
            top = self.params.max_new_tokens
            params = replace(self.params, max_new_tokens=min(request.max_tokens or top, top, room))
            first = state.traj.calls
            state.traj.calls += request.n
            fault_point("agent_request")  # the request read, its answers not yet generated
            completions = self._complete(state, row, first, ids, params, request.n)
            fault_point("agent_answered")  # its answers generated and journaled, not yet sent
            answers, candidates = [], []
            for j, c in enumerate(completions):
                answer = make_answer(self.renderer, c, request, f"call_{first + j}")
                answers.append(answer)
                message = answer.message or {}
                candidates.append(
                    Candidate(answer.ids, answer.logprobs, c.weight_version,
                              answer.finish_reason != "length", message, answer.text)
                )  # fmt: skip
            with state.flag:
                if state.ended:
                    raise ApiError("this sample's agent has ended; its key is closed", 409)
                if plan.candidate is not None:
                    taken = state.traj.candidates[plan.candidate].message
                    state.tool_calls += len(taken.get("tool_calls") or [])
                state.traj.commit(plan, candidates)
        return answers, ids

    def _complete(
        self, state: _Row, row: int, first: int, ids: list[int], params: SamplingParams, n: int
    ) -> list[Completion]:
        """n completions of `ids`: the journal's where it holds this very request, else the
        engine's (one batch with the other live agents)."""
        out: list[Completion | None] = [None] * n
        todo = []
        for j in range(n):
            call = first + j
            entry = None if state.diverged else self.journal.get(self.slot, self._key(row, call))
            if entry is not None:
                if entry["request"] == _digest(ids, params, self._seed(row, call, params)):
                    out[j] = Completion(
                        list(ids), entry["ids"], entry["logprobs"], entry["finished"],
                        entry["version"],
                    )  # fmt: skip
                    self.replayed += 1
                    continue
                state.diverged = True  # from here on this sample samples afresh
                self.diverged_labels.append(state.label)
            todo.append(call)
        if todo:
            if self.loop is None or self.loop.is_closed():
                raise ApiError("this sample's rollout has ended", 409)
            try:
                future = asyncio.run_coroutine_threadsafe(
                    self._engine(row, todo, ids, params), self.loop
                )
                turns = future.result()
            except (concurrent.futures.CancelledError, RuntimeError):
                raise ApiError("this sample's rollout has ended", 409) from None
            except BaseException as exc:  # noqa: BLE001 - the engine failed: the run stops
                self.failure = exc
                raise ApiError(f"the run's engine failed: {exc}", 503) from None
            for call, turn in zip(todo, turns, strict=True):
                out[call - first] = Completion(
                    list(ids), turn.ids, turn.logprobs, turn.finish_reason == "stop",
                    turn.weight_version,
                )  # fmt: skip
        return [c for c in out if c is not None]

    async def _engine(self, row: int, calls: list[int], ids: list[int], params: SamplingParams):
        loop = asyncio.get_running_loop()
        requests = [
            _Request(row, call, list(ids), params, self._seed(row, call, params),
                     loop.create_future())
            for call in calls
        ]  # fmt: skip
        return await self.batcher.request_many(requests)

    def _seed(self, row: int, call: int, params: SamplingParams) -> int | None:
        """The seed of call `call` of sample `row` (the one a generate function's client uses)."""
        if params.greedy:
            return None
        state = self.rows[row]
        purpose = f"rollout/{self.slot}/{state.position}/{state.index}"
        return derive_seed(self.seed, purpose, call) & ROW_SEED_MASK

    def _key(self, row: int, call: int) -> str:
        state = self.rows[row]
        return f"agent/{self.slot}/{state.position}/{state.index}/{call}"

    def _journal_batch(self, requests: list[_Request], completions: list[Completion]) -> None:
        self.journal.record_batch(
            self.slot,
            [
                {
                    "key": self._key(r.sample, r.call),
                    "request": _digest(r.ids, r.params, r.seed),
                    "ids": list(c.response_ids),
                    "logprobs": list(c.logprobs),
                    "finished": c.finished,
                    "version": c.weight_version,
                }
                for r, c in zip(requests, completions, strict=True)
            ],
        )

    # --- the agents (the rollout's event loop) ------------------------------------------------

    async def _agent(self, row: int, sample: Sample) -> tuple[str | None, Any]:
        """(None, what the agent returned), or (its failure's stop reason, the line naming it)."""
        state = self.rows[row]
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        state.clock.start()
        try:
            if inspect.iscoroutinefunction(self.fn):
                task = asyncio.ensure_future(self.fn(state.base_url, state.key, sample))
            else:
                task = self.loop.run_in_executor(
                    self._executor, self.fn, state.base_url, state.key, sample
                )
            state.task = task
            try:
                return None, await task
            except asyncio.CancelledError:
                if state.timed_out:
                    limit = self.limits.timeout
                    return AGENT_TIMEOUT, f"ran past --agent-timeout {limit:g}s of its own"
                raise
            except BaseException as exc:  # noqa: BLE001 - the sample's failure, named
                return AGENT_ERROR, f"raised {type(exc).__name__}: {exc}{where(exc)}"
        finally:
            state.clock.finish()

    def run(self, inputs: list[Sample], labels: list[str], rows: list[tuple[int, int]]):
        """Run one agent per input sample; the trained samples, in order."""
        self.rows = [_Row(self.renderer, p, i, lb) for (p, i), lb in zip(rows, labels, strict=True)]
        for row, state in enumerate(self.rows):
            state.base_url, state.key = self.endpoint.add(self.sample_handler(row))
        limit = self.limits.max_concurrency
        workers = min(len(inputs), limit or len(inputs)) or 1
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, "mileage agent")
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                coroutines = [self._agent(row, copy.deepcopy(s)) for row, s in enumerate(inputs)]
                box["results"] = self.batcher.run(coroutines, limit)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=body, name="mileage agents", daemon=True)
        try:
            thread.start()
            self._watch(thread)
        finally:
            for state in self.rows:
                self.endpoint.remove(state.key)
                with state.flag:
                    state.ended = True
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.failure is not None:
            raise self.failure
        if "error" in box:
            raise box["error"]
        samples = [
            self._sample(state, given, *result)
            for state, given, result in zip(self.rows, inputs, box["results"], strict=True)
        ]
        failed = [s.agent_failure for s in samples if s.agent_failure]
        for line in failed[:SHOWN_FAILURES]:
            print(f"agent: {line}", file=sys.stderr)
        if len(failed) > SHOWN_FAILURES:
            more = len(failed) - SHOWN_FAILURES
            print(f"agent: ... and {more} more (rollout/agent_failures)", file=sys.stderr)
        if self.diverged_labels:
            print(
                f"agent: {len(self.diverged_labels)} sample(s) asked other than the journal "
                f"recorded, first {self.diverged_labels[0]}: the agent is not deterministic "
                "given its inputs; those samples continue from their first divergence with "
                "fresh samples (docs/agents.md)",
                file=sys.stderr,
            )
        return samples

    def _watch(self, thread: threading.Thread) -> None:
        """Cancel each agent past its time limit; stop the run (one line) when one blocks the
        event loop, which nothing else could then end."""
        timeout = self.limits.timeout
        while thread.is_alive():
            thread.join(0.05)
            now = time.monotonic()
            for state in self.rows:
                task = state.task
                if task is None or state.clock.finished:
                    continue
                if not state.timed_out and state.clock.own(now) > timeout:
                    state.timed_out, state.cancelled_at = True, now
                    assert self.loop is not None
                    self.loop.call_soon_threadsafe(task.cancel)
                elif state.timed_out and now - state.cancelled_at > CANCEL_GRACE_S:
                    raise UserError(
                        f"{AGENT_FLAG}: the agent of {state.label} ran past --agent-timeout "
                        f"{timeout:g}s and did not stop when cancelled: it blocks the event "
                        "loop (a synchronous call inside `async def`?); await instead, or "
                        "write the agent as a plain `def` (it then runs in a thread)"
                    )

    def _sample(self, state: _Row, given: Sample, failure: str | None, result: Any) -> Sample:
        """The trained sample of one agent's trajectory."""
        with state.flag:
            state.ended = True
            seg = state.traj.finish()
        sample = copy.deepcopy(given)
        reward = None
        if failure is None:
            reward, failure, result = judge(result, called=seg is not None)
        if seg is not None:
            sample.prompt_ids = list(seg.prompt_ids)
            sample.response_ids = list(seg.response_ids)
            sample.logprobs = list(seg.logprobs)
            sample.loss_mask = list(seg.mask)
            sample.weight_versions = list(seg.versions)
            if seg.versions:
                sample.weight_version = seg.versions[0]
        decode = self.renderer.tokenizer.decode
        sample.response = decode(sample.response_ids, skip_special_tokens=True)
        sample.turns = state.traj.requests
        sample.finished = failure is None and state.traj.last_finished
        sample.stop_reason = failure or (STOP if sample.finished else LENGTH)
        stats = state.traj.stats()
        stats["tool_calls"] = float(state.tool_calls)
        stats["diverged"] = float(state.diverged)
        stats["own_reward"] = float(reward is not None)
        sample.agent_stats = stats
        if failure is not None:
            sample.loss_mask = [0] * len(sample.response_ids)  # nothing of a failure is trained
            sample.agent_failure = f"{state.label}: {failure}: {result}"
        sample.reward = 0.0 if reward is None else reward
        return sample


class _SampleHandle:
    """What the endpoint holds for one key: the rollout and the sample's row."""

    def __init__(self, rollout: AgentRollout, row: int):
        self.rollout, self.row = rollout, row

    def handle(self, request: Request) -> tuple[list[Answer], list[int]]:
        return self.rollout.handle(self.row, request)
