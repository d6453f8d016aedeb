"""Generation in background threads, for train-async, in one process or under torchrun.

Under torchrun a remote engine is driven by rank 0 (`RemoteEngineOnRank0`), whose `generate`
is a collective (a broadcast of the completions). A collective in a background thread would
race the training's own collectives, so here rank 0's threads talk to the servers directly and
the other ranks run no thread at all; when the driver collects a slot (the same point of the
program on every rank), rank 0 broadcasts its result, or its one-line error, to the others.
In one process this is a thread pool and nothing else. The driver never sees the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mileage.distributed import env
from mileage.distributed.coordination import on_rank0
from mileage.distributed.remote import RemoteEngineOnRank0


class BackgroundGeneration:
    """Runs `job(engine, *args)` in background threads where the engine is driven."""

    def __init__(self, engine, workers: int):
        remote = isinstance(engine, RemoteEngineOnRank0)
        # rank 0 drives the servers through its own (non-collective) client
        self.engine = engine.engine if remote else engine
        self.here = env.is_main() or not remote
        self.shared = remote and env.is_distributed()  # results travel by broadcast
        self.pool = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mileage-gen")
            if self.here
            else None
        )

    def submit(self, job: Callable[..., Any], *args: Any) -> Future | None:
        """Starts the job on the rank that generates (None elsewhere)."""
        return self.pool.submit(job, self.engine, *args) if self.pool is not None else None

    def result(self, future: Future | None) -> Any:
        """The job's result on every rank (a collective under torchrun: every rank calls it,
        in the same order)."""
        if not self.shared:
            return future.result()
        return on_rank0(lambda: future.result())  # called on rank 0 only

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
