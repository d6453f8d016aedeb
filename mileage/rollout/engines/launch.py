"""Starting a server process that cannot outlive mileage.

The server runs under a small supervisor (`python -m mileage.rollout.engines.launch PARENT --
CMD...`) that leads a new process group, asks the kernel for SIGTERM when its parent dies
(PR_SET_PDEATHSIG), and on SIGTERM kills its whole group with SIGKILL. So a SIGKILLed mileage
takes the server and everything the server started (vLLM's engine-core processes) with it, and
`ServerProcess.stop` ends the group the same way. This module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mileage.parent_death import die_with_parent


def free_port() -> int:
    """A port nothing listens on right now (on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_group(*_args) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def supervise(parent: int, command: list[str]) -> int:
    signal.signal(signal.SIGTERM, _kill_group)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before this process even started
        _kill_group()
    child = subprocess.Popen(command)  # same process group as this supervisor
    return child.wait()


class ServerProcess:
    """A supervised server; `stop` ends its process group."""

    def __init__(self, command: list[str], log_path: Path, env: dict[str, str]):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mileage.rollout.engines.launch",
                str(os.getpid()),
                "--",
                *command,
            ],  # fmt: skip
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 600) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " / ".join(text[-chars:].strip().splitlines()[-6:])

    def stop(self, grace: float = 10.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        self._log.close()


if __name__ == "__main__":
    separator = sys.argv.index("--")
    sys.exit(supervise(int(sys.argv[1]), sys.argv[separator + 1 :]))
