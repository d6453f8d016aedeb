"""Tool calls in worker processes, so a tool that hangs can be killed without stopping the run.

A thread cannot be killed, so a hung tool run in one would hold its thread (and whatever it
locked) for the rest of the run. Each tool call here runs in one of up to `--tool-workers`
long-lived worker processes (spawned, so they share no locks or CUDA state with the trainer);
a call that raises comes back as ("tool_error", "ExceptionType: message"), a call that runs past
`--tool-timeout` seconds has its worker killed (and replaced on the next call) and comes back as
("tool_timeout", ...). Neither stops the run: the trajectory ends with that reason.

The tool function is loaded in each worker from the path the user gave
(`--generate-execute-tool-function-path`), called as `fn(name, arguments)`, sync or async, and
must return a string (anything else is a tool_error).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import Any

from mileage.faults import fault_point
from mileage.rollout.toolworker import READY, TOOL_ERROR, TOOL_TIMEOUT, serve

# seconds a new worker may take to start and import the tool's module (not part of any call's
# --tool-timeout)
STARTUP_TIMEOUT = 120.0


class _Worker:
    def __init__(self, path: str):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(path, child, os.getpid()), daemon=True)
        self.process.start()
        child.close()
        self.ready = False  # the worker has loaded the tool and said so

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=5)
        self.conn.close()


class ToolPool:
    """Up to `workers` tool worker processes; `await call(name, arguments)` -> (status, output)."""

    def __init__(self, path: str, timeout: float, workers: int):
        self.path = path
        self.timeout = timeout
        self.workers = workers
        self._idle: list[_Worker] = []
        self._started = 0
        self._lock = threading.Lock()
        # a thread semaphore, not an asyncio one: train-async may run several rollouts' event
        # loops at once, in threads, against the same pool
        self._slots = threading.BoundedSemaphore(workers)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.process.is_alive():
                    return worker
                worker.kill()  # died while idle (killed from outside): replaced below
            self._started += 1
        return _Worker(self.path)

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _call_blocking(self, name: str, arguments: dict[str, Any]) -> tuple[str, str]:
        with self._slots:
            return self._call_in_worker(name, arguments)

    def _call_in_worker(self, name: str, arguments: dict[str, Any]) -> tuple[str, str]:
        worker = self._take()
        try:
            if not worker.ready:
                if not worker.conn.poll(STARTUP_TIMEOUT) or worker.conn.recv() != READY:
                    worker.kill()
                    return TOOL_ERROR, f"the tool's worker did not start in {STARTUP_TIMEOUT}s"
                worker.ready = True
            worker.conn.send((name, arguments))
            fault_point("tool_running")  # the trainer killed while the tool runs
            if not worker.conn.poll(self.timeout):
                worker.kill()
                return TOOL_TIMEOUT, f"tool {name!r} ran past --tool-timeout {self.timeout:g}s"
            status, output = worker.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            worker.kill()  # the worker died (the tool called os._exit, was OOM-killed, ...)
            return TOOL_ERROR, f"the tool's worker process died ({type(exc).__name__})"
        except Exception:
            worker.kill()
            raise
        self._give(worker)
        return status, output

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, str]:
        return await asyncio.to_thread(self._call_blocking, name, arguments)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.conn.close()  # the worker returns on EOF
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.kill()
