"""train-async's producer: slots generated in background threads, collected in submission order.

A slot is one rollout's worth of generation with the weights the schedule gives it. Three kinds:

- plain: its prompts are drawn on the trainer's thread at submission (stale groups' prompts
  first), and generated in the background;
- a user rollout function (`--rollout-function-path`): one call of the function per slot, in
  the generation thread, drawing its own prompts;
- a sampling round of `--partial-rollout`: the groups still in flight (oldest first, up to
  `--rollout-batch-size` of them) continue by at most the round's token budget with the slot's
  weights, and new prompts fill the round; the groups that finish are the slot's, the others
  stay in flight for the next slot.

The last two draw from the data in the thread, so their slots are chained: a slot starts only
after the one before it returned, taking the data position (and the groups in flight) it left.
Whatever the timing, the data is drawn in submission order, and when nothing is in flight (after
`drain`, before every save) the run's data position and `RolloutBuffer.partial` are the last
slot's. What a slot keeps never depends on timing: the filter judges groups as slots are
collected, in submission order.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from mileage.components import Run
from mileage.distributed.background import BackgroundGeneration
from mileage.faults import fault_point
from mileage.rollout.buffer import Group, RolloutBuffer, split_groups
from mileage.rollout.dynamic import judge
from mileage.rollout.rollout import save_samples
from mileage.sources.on_policy import generate_with, round_generator


@dataclass
class SlotResult:
    """A generated slot: its samples, the generation thread's seconds on it and the response
    tokens it generated. A slot that drew its own prompts also carries the data position after
    it and the retried prompts it left; a partial-rollout round its finished groups (each with
    the weights it started from) and the groups still in flight after it."""

    samples: list
    seconds: float
    tokens: int
    position: dict | None = None
    unused_retries: list = field(default_factory=list)
    groups: list[Group] | None = None
    in_flight: list[Group] = field(default_factory=list)


class RetriesFirst:
    """The data a slot draws from in the thread: the slot's retried prompts first (stale
    groups' prompts, handed to it in submission order), then the run's data."""

    def __init__(self, retries: list, data):
        self.retries = list(retries)
        self.data = data

    def next_batch(self, size: int) -> list:
        head, self.retries = self.retries[:size], self.retries[size:]
        return head + (self.data.next_batch(size - len(head)) if size > len(head) else [])

    def __getattr__(self, name: str):
        return getattr(self.data, name)


def response_tokens(samples) -> int:
    return sum(len(s.response_ids) for s in samples)


class Producer:
    """Generates slots in a background thread; results are collected in submission order."""

    def __init__(self, run: Run, buffer: RolloutBuffer, workers: int):
        self.run = run
        self.buffer = buffer
        # threads where the engine is driven (under torchrun: rank 0, results broadcast)
        self.background = BackgroundGeneration(run.engine, workers)
        self.pending: deque[tuple[int, int, Future | None]] = deque()  # (slot, policy, result)
        # slot -> (seconds the generation thread spent on it, its response tokens): the
        # throughput of a rollout is the generator's, not tokens over the trainer's wait
        self.slot_time: dict[int, tuple[float, int]] = {}
        self.user_rollout = run.agent is not None and run.agent.user.rollout is not None
        self.partial = run.cfg.dynamic.partial_rollout
        self.last_chained: Future | None = None  # the last slot that draws in the thread

    def submit(self, policy_rollouts: int) -> None:
        """The next slot, generated with the engine's current weights (`policy_rollouts`)."""
        run, size = self.run, self.run.cfg.rollout.rollout_batch_size
        retries = self.buffer.draw_retries(size)  # stale groups' prompts, before new data
        slot = self.buffer.next_slot
        self.buffer.next_slot += 1
        if self.user_rollout or self.partial:
            # the first chained slot of this process continues the groups a checkpoint left
            in_flight = list(self.buffer.partial)
            job = self.background.submit(
                self._chained, slot, policy_rollouts, retries, self.last_chained, in_flight
            )
            self.last_chained = job
        else:
            prompts = retries + run.data.next_batch(size - len(retries))  # drawn here, in order
            job = self.background.submit(self._generate, slot, prompts)
        self.pending.append((slot, policy_rollouts, job))

    def _generate(self, engine, slot: int, prompts) -> SlotResult:
        """The slot's samples and the seconds this thread spent generating them."""
        fault_point("async_generating")  # in the thread, while the trainer trains
        began = time.perf_counter()
        samples = self._samples(engine, slot, prompts)
        return SlotResult(samples, time.perf_counter() - began, response_tokens(samples))

    def _samples(self, engine, slot: int, prompts) -> list:
        """`prompts`' scored groups, seeded by `slot` (the run's own generation)."""
        return generate_with(engine, self.run, slot, prompts)

    def _chained(
        self,
        engine,
        slot: int,
        policy: int,
        retries: list,
        previous: Future | None,
        in_flight: list[Group],
    ) -> SlotResult | None:
        """A slot that draws its own prompts, once the slot before it has returned: the user's
        rollout function, or a partial-rollout round continuing the groups that slot left."""
        if previous is not None:
            wait([previous])
            if previous.cancelled() or previous.exception() is not None:
                return None  # the run stops at that slot, which is collected first
            in_flight = previous.result().in_flight
        fault_point("async_generating")
        began = time.perf_counter()
        data = RetriesFirst(retries, self.run.data)
        groups = None
        if self.user_rollout:
            samples = self.run.agent.run_rollout(
                engine, slot, data, lambda prompts: self._samples(engine, slot, prompts)
            )
            tokens = response_tokens(samples)
        else:
            # copies: the slot before's result still holds these groups as they were
            in_flight = copy.deepcopy(in_flight)
            before = response_tokens(s for g in in_flight for s in g.samples)
            groups, in_flight = self._round(engine, slot, policy, data, in_flight)
            samples = [s for g in groups for s in g.samples]
            tokens = response_tokens(s for g in [*groups, *in_flight] for s in g.samples) - before
        seconds = time.perf_counter() - began
        position = self.run.data.state_dict()
        return SlotResult(samples, seconds, tokens, position, data.retries, groups, in_flight)

    def _round(
        self, engine, slot: int, policy: int, data: RetriesFirst, in_flight: list[Group]
    ) -> tuple[list[Group], list[Group]]:
        """--partial-rollout: the slot's round (the oldest groups in flight continued, new
        prompts for the rest of its size); the groups that finished in it, each with the
        weights it started from, and those still in flight after it, oldest first."""
        size = self.run.cfg.rollout.rollout_batch_size
        waiting = deque(in_flight)
        carried = [waiting.popleft() for _ in range(min(size, len(waiting)))]
        generator = round_generator(self.run, engine)  # here, in the generation thread
        groups = generator(carried, data.next_batch(size - len(carried)), slot, policy)
        finished = [g for g in groups if generator.group_done(g)]
        waiting.extendleft(reversed([g for g in groups if not generator.group_done(g)]))
        for group in finished:  # timed with the round that finished it
            group.slot = slot
        return finished, list(waiting)

    def groups_ahead(self) -> int:
        """Groups generated or generating that no rollout has taken yet."""
        size = self.run.cfg.rollout.rollout_batch_size
        return len(self.buffer.groups) + len(self.pending) * size

    def collect_oldest(self) -> None:
        slot, policy, future = self.pending.popleft()
        result = self.background.result(future)
        samples = result.samples
        self.slot_time[slot] = (result.seconds, result.tokens)
        if result.position is not None:  # the slot drew its own prompts, in the thread
            self.buffer.retry = result.unused_retries + self.buffer.retry
            if not self.pending:  # no slot draws now: the position is the last slot's
                self.run.data.load_state_dict(result.position)
                self.buffer.partial = deque(result.in_flight)
        rc = self.run.cfg.rollout
        if rc.save_debug_rollout_data:
            save_samples(rc.save_debug_rollout_data, slot, samples)
        n = rc.n_samples_per_prompt
        groups = (
            result.groups if result.groups is not None else split_groups(slot, policy, samples, n)
        )
        keep = self.run.group_filter
        for group in groups:
            # dynamic sampling: judged as the slot is collected, in submission order, so what
            # is kept never depends on timing; the rollout short of groups takes more slots
            kept, reason = (True, "") if keep is None else judge(keep, self.run.cfg, group.samples)
            if kept:
                self.buffer.groups.append(group)
            else:
                self.buffer.filtered[reason] = self.buffer.filtered.get(reason, 0) + 1

    def forget_times(self, untrained_slots) -> None:
        """Drop the times of slots no untrained group or slot in flight comes from."""
        keep = {*untrained_slots, *(slot for slot, _, _ in self.pending)}
        self.slot_time = {s: t for s, t in self.slot_time.items() if s in keep}

    def drain(self) -> None:
        """Wait for every slot in flight (before the engine's weights change, and before a save)."""
        while self.pending:
            self.collect_oldest()

    def close(self) -> None:
        self.background.close()
