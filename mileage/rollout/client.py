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
from collections.abc import Awaitable
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

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: list[_Request] = []
        self.live = 0
        self.calls = 0  # engine calls made (batches)

    async def request(self, request: _Request) -> TurnOutput:
        self.pending.append(request)
        self._schedule()
        return await request.future

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

    def run(self, coroutines: list[Awaitable[Any]]) -> list[Any]:
        """Run the coroutines (one per sample, in sample order) to completion; their results
        in order. The first exception raised by one of them is raised here."""

        async def main() -> list[Any]:
            tasks = [asyncio.ensure_future(c) for c in coroutines]
            self.live = len(tasks)

            def finished(_task: asyncio.Task) -> None:
                self.live -= 1
                self._flush_if_ready()

            for task in tasks:
                task.add_done_callback(finished)
            try:
                return await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()

        return asyncio.run(main())


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
