"""`mileage serve` processes for tests and scripts: started on a free loopback port in their
own process group, stopped by that group, every wait bounded."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_LISTENING = re.compile(r"listening on (http://\S+)")


class ServeProcess:
    """One `mileage serve --port 0`; `url` is known once it listens."""

    def __init__(self, hf_checkpoint: str | Path, env: dict[str, str] | None = None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("MILEAGE_KILL_AT", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mileage",
                "serve",
                "--hf-checkpoint",
                str(hf_checkpoint),
                "--port",
                "0",
                "--num-threads",
                "1",
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,  # its own process group: stopped as a whole, never by name
        )
        self.output: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            match = _LISTENING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> str:
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"mileage serve did not start: {''.join(self.output)[-2000:]}")
        return self.url

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_servers(
    hf_checkpoint: str | Path, count: int, env: dict[str, str] | None = None
) -> list[ServeProcess]:
    """`count` servers started at once (their start-up overlaps), each ready or raising."""
    servers = [ServeProcess(hf_checkpoint, env) for _ in range(count)]
    deadline = time.monotonic() + 180
    try:
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except RuntimeError:
        for server in servers:
            server.stop()
        raise
    return servers
