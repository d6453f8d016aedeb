"""The tool worker process's main function (`mileage.rollout.toolpool`).

Kept apart and free of torch: a spawned worker imports only this module, the standard library
and the user's tool module, so starting (or replacing) one is cheap.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import os
import signal
import threading
import time

# statuses of a tool call (the same strings as mileage.rollout.sample's stop reasons)
OK = "ok"
TOOL_ERROR = "tool_error"
TOOL_TIMEOUT = "tool_timeout"
READY = "ready"


def _exit_with_parent(parent: int) -> None:
    """End this worker when the trainer is gone (killed mid-call, a hung tool included). Not
    PR_SET_PDEATHSIG: that fires when the parent *thread* that started us ends, and workers
    are started from short-lived executor threads."""
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            os._exit(1)


def serve(path: str, conn: multiprocessing.connection.Connection, parent: int) -> None:
    """Serve tool calls on `conn` until it closes: (name, arguments) -> (status, output)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which ends us
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    import inspect

    from mileage.errors import UserError
    from mileage.rollout.userfn import load_function

    try:
        fn = load_function(path, "--generate-execute-tool-function-path")
    except UserError as exc:
        fn, load_error = None, str(exc)
    # the trainer starts a call's timeout only after this: a slow start (a loaded machine, a
    # heavy tool module) must not turn into a timeout of the first call
    conn.send(READY)
    while True:
        try:
            name, arguments = conn.recv()
        except (EOFError, OSError):
            return
        if fn is None:
            conn.send((TOOL_ERROR, load_error))
            continue
        try:
            result = fn(name, arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
            if not isinstance(result, str):
                reply = (TOOL_ERROR, f"the tool returned {type(result).__name__}, not str")
            else:
                reply = (OK, result)
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the trajectory's
            reply = (TOOL_ERROR, f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        conn.send(reply)


async def _await(value):
    return await value
