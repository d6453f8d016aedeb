"""The token-in/token-out client a generate function samples through, and the batcher behind it.

A rollout runs one coroutine per sample (`--custom-generate-function-path`, or the built-in tool
loop) on one event loop. Each coroutine samples with `await ctx.client.generate(ids)`; the
`TurnBatcher` holds those requests until every live coroutine is either waiting on the engine or
finished, then sends them to the engine as ONE call, in (sample, call) order. That makes the
batches, and so every sampled token, independent of how long tools or rewards take: turn k of
all live trajectories goes into one batch (turn-synchronous), whatever finished first.

Seeds. Call c of sample j of prompt i in rollout (slot) N samples with the seed
`derive_seed(seed, f"{purpose}/{N}/{i}/{j}", c)`, a pure function of its key: the local engine
gives that row its own generator, a remote engine sends it as the row's seed. A rerun, or a
trajectory resumed from the tool journal, draws exactly the same numbers.

A generate function keeps exactness by awaiting one thing at a time (a client call, or a tool
call, or anything else): a coroutine that waits on a client call AND on something else at once
(asyncio.gather of both) lets a batch go before the other thing finishes, and the batches then
depend on timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mileage.rollout.engines.base import (
    ROW_SEED_MASK,
    Completion,
    Engine,
    RowSeeds,
    SamplingParams,
)
from mileage.seeding import derive_seed


@dataclass(frozen=True)
class TurnOutput:
    """What one client call sampled: the new ids with their log-probs."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached)
    weight_version: int


@dataclass
class _Request:
    sample: int  # position of the sample in the rollout
    call: int  # the sample's call number
    ids: list[int]
    params: SamplingParams
    seed: int | None
    future: asyncio.Future = field(repr=False)


class TurnBatcher:
    """Runs one rollout's generate coroutines and batches their engine calls deterministically
    (module docstring). Engine calls block the event loop: nothing else can run then anyway,
    since every live coroutine is waiting on the engine."""

    def __init__(
        self,
        engine: Engine,
        on_batch: Callable[[list[_Request], list[Completion]], None] | None = None,
    ):
        self.engine = engine
        # called with each engine call's requests and completions before any is handed out
        # (the agent journal records them there, as one line)
        self.on_batch = on_batch
        self.pending: list[_Request] = []
        self.live = 0
        self.calls = 0  # engine calls made (batches)

    async def request(self, request: _Request) -> TurnOutput:
        self.pending.append(request)
        self._schedule()
        return await request.future

    async def request_many(self, requests: list[_Request]) -> list[TurnOutput]:
        """Several requests of one sample at once (an agent's n > 1): in the same batch."""
        self.pending.extend(requests)
        self._schedule()
        return list(await asyncio.gather(*(r.future for r in requests)))

    def _schedule(self) -> None:
        asyncio.get_running_loop().call_soon(self._flush_if_ready)

    def _flush_if_ready(self) -> None:
        waiting = {r.sample for r in self.pending}
        if not self.pending or len(waiting) < self.live:
            return
        batch = sorted(self.pending, key=lambda r: (r.sample, r.call))
        self.pending = []
        # one engine call per distinct sampling parameters (max_new_tokens differs when the
        # response budget runs low), in order of their first sample
        groups: dict[SamplingParams, list[_Request]] = {}
        for r in batch:
            groups.setdefault(r.params, []).append(r)
        for params, requests in groups.items():
            try:
                completions = self._generate(params, requests)
                if self.on_batch is not None:
                    self.on_batch(requests, completions)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutines
                for r in requests:
                    r.future.set_exception(exc)
                continue
            for r, c in zip(requests, completions, strict=True):
                r.future.set_result(_turn_output(c))

    def _generate(self, params: SamplingParams, requests: list[_Request]) -> list[Completion]:
        self.calls += 1
        seeds = None if params.greedy else RowSeeds(tuple(r.seed for r in requests))
        return self.engine.generate([r.ids for r in requests], params, seeds)

    def run(self, coroutines: list[Awaitable[Any]], max_live: int | None = None) -> list[Any]:
        """Run the coroutines (one per sample, in sample order) to completion; their results
        in order. The first exception raised by one of them is raised here.

        With `max_live`, at most that many run at once: the first `max_live` start, and each
        one that finishes starts the next in sample order before any batch is sent, so the
        batches are the same whatever finished first."""
        waiting = list(coroutines)
        waiting.reverse()

        async def main() -> list[Any]:
            loop = asyncio.get_running_loop()
            futures: list[asyncio.Future] = [loop.create_future() for _ in coroutines]
            tasks: list[asyncio.Task] = []
            limit = len(coroutines) if max_live is None else max(1, max_live)

            def start_next() -> None:
                index = len(tasks)
                task = asyncio.ensure_future(waiting.pop())
                tasks.append(task)
                self.live += 1
                task.add_done_callback(lambda t: finished(index, t))

            def finished(index: int, task: asyncio.Task) -> None:
                self.live -= 1
                if waiting:
                    start_next()  # before the check below: its first request joins the batch
                if task.cancelled():
                    futures[index].cancel()
                elif task.exception() is not None:
                    futures[index].set_exception(task.exception())
                else:
                    futures[index].set_result(task.result())
                self._flush_if_ready()

            self.live = 0
            while waiting and len(tasks) < limit:
                start_next()
            try:
                return await asyncio.gather(*futures)
            finally:
                for task in tasks:
                    task.cancel()

        try:
            return asyncio.run(main())
        finally:
            for coroutine in waiting:  # never started (the run failed first)
                close = getattr(coroutine, "close", None)
                if close is not None:
                    close()


def _turn_output(c: Completion) -> TurnOutput:
    return TurnOutput(
        list(c.response_ids),
        list(c.logprobs),
        "stop" if c.finished else "length",
        c.weight_version,
    )


class TokenClient:
    """The async token-in/token-out client of one sample, over the run's engine (local,
    `mileage serve`, SGLang or vLLM alike)."""

    def __init__(
        self,
        batcher: TurnBatcher,
        params: SamplingParams,
        seed_key: tuple[int, str],
        sample: int,
    ):
        self._batcher = batcher
        self.params = params  # the run's sampling parameters (the default of each call)
        self._seed, self._purpose = seed_key
        self._sample = sample
        self.calls = 0  # calls made so far (the next call's number, which keys its seed)

    def seed_of(self, call: int) -> int:
        """The seed call `call` of this sample samples with."""
        return derive_seed(self._seed, self._purpose, call) & ROW_SEED_MASK

    async def generate(self, input_ids: list[int], max_new_tokens: int | None = None) -> TurnOutput:
        """Sample a continuation of `input_ids` (the whole context so far: prompt and every
        earlier turn, as ids) with the run's temperature and top-p; at most `max_new_tokens`
        new tokens (default: --rollout-max-response-len)."""
        if not input_ids:
            raise ValueError("generate needs at least one input id")
        params = self.params
        if max_new_tokens is not None:
            if max_new_tokens <= 0:
                raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
            params = replace(params, max_new_tokens=max_new_tokens)
        call = self.calls
        self.calls += 1
        seed = None if params.greedy else self.seed_of(call)
        loop = asyncio.get_running_loop()
        request = _Request(self._sample, call, list(input_ids), params, seed, loop.create_future())
        return await self._batcher.request(request)
