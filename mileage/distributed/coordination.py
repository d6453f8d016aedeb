"""Decisions every rank must take together: work only rank 0 can do, who holds the save
directory, and when to stop.

Rank 0 alone reads weight files and talks to rollout servers; `on_rank0` and `stop_together`
share its result or its refusal, so a one-line error there stops every rank with that line where
the others would otherwise wait in the next collective until its timeout.

Rank 0 holds the save directory's lock (`SaveDirLock`); the other ranks learn whether it got it
and stop with the same one-line error if not, so a second torchrun job on a --save in use exits
on every rank with exit code 2 (torchrun itself then reports a failure). A SIGTERM or the save
trigger sentinel may reach one rank a rollout before another; the ranks agree at the end of each
rollout, so all of them save that rollout and stop together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

from mileage.checkpoint.lock import SaveDirLock
from mileage.distributed import env
from mileage.errors import UserError
from mileage.preemption import PreemptionGuard
from mileage.progress import RunProgress

T = TypeVar("T")


def on_rank0(work: Callable[[], T]) -> T:
    """`work()` on rank 0, its result (or its UserError) on every rank."""
    outcome: tuple[str, Any] | None = None
    if env.is_main():
        try:
            outcome = ("ok", work())
        except UserError as exc:
            outcome = ("error", str(exc))
    kind, value = env.broadcast_object(outcome)
    if kind == "error":
        raise UserError(value)
    return value


def stop_together(work: Callable[[], T]) -> T:
    """`work()` on every rank, each keeping its own result (rank 0's may be a model, which is
    never sent); a UserError on rank 0 is raised on every rank."""
    if not env.is_distributed():
        return work()
    result, error = None, None
    try:
        result = work()
    except UserError as exc:
        error = str(exc)
    shared = env.broadcast_object(error if env.is_main() else None)
    if shared is not None or error is not None:
        raise UserError(shared if shared is not None else error)
    return result


@contextmanager
def save_dir_lock(save: str | None) -> Iterator[SaveDirLock | None]:
    """The save directory's lock, held by rank 0 for the whole run (None without --save)."""
    if not save or not env.is_distributed():
        with SaveDirLock(save) if save else nullcontext() as lock:
            yield lock
        return
    lock = SaveDirLock(save)
    on_rank0(lambda: lock.acquire() and None)  # the lock object stays on rank 0
    try:
        yield lock
    finally:
        lock.release()  # a no-op on ranks that never acquired it


class AgreedPreemption:
    """A `PreemptionGuard` whose answers are the same on every rank.

    `stop_requested` and `sentinel_present()` are collectives: the loop asks each exactly once
    per rollout, on every rank.
    """

    def __init__(self, guard: PreemptionGuard):
        self.guard = guard
        self.signal_name: str | None = None

    @property
    def stop_requested(self) -> bool:
        names = [n for n in env.all_gather_object(self.guard.signal_name) if n]
        self.signal_name = names[0] if names else None
        if self.signal_name is not None:
            self.guard.reached_save()
        return self.signal_name is not None

    def sentinel_present(self) -> bool:
        return bool(env.broadcast_object(self.guard.sentinel_present()))

    def clear_sentinel(self) -> None:
        if env.is_main():
            self.guard.clear_sentinel()

    def __enter__(self) -> AgreedPreemption:
        self.guard.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.guard.__exit__(*exc)


def preemption_guard(
    sentinel: str | None, grace: float = 0.0
) -> PreemptionGuard | AgreedPreemption:
    guard = PreemptionGuard(sentinel, grace)
    return AgreedPreemption(guard) if env.is_distributed() else guard


class _SilentProgress(RunProgress):
    """Progress of a rank other than 0: only rank 0 prints."""

    def print(self, text: str) -> None:
        pass


def run_progress(start: int, total: int) -> RunProgress:
    if env.is_main():
        return RunProgress(start, total)
    return _SilentProgress(start, total, enabled=False)
