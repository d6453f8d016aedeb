"""One writer per save directory.

`SAVE/.mileage.lock` is held with an exclusive `flock` for the life of the run and names its
holder (pid, host, start time). The kernel drops a flock when its process dies, so a lock left
by a killed run is recognisably stale: the next run takes it over and says so.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from mileage.errors import UserError

LOCK_FILE = ".mileage.lock"


class SaveDirLock:
    def __init__(self, save_dir: str | Path):
        self.path = Path(save_dir) / LOCK_FILE
        self._fd: int | None = None
        self.previous_holder: dict | None = None  # set when a stale lock was taken over

    def acquire(self) -> SaveDirLock:
        # the run's first write into --save: what the OS refuses is one line naming the path
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot create --save directory {self.path.parent}: {exc.strerror}"
            ) from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            remedy = (
                " (remove it: mileage keeps its lock file at that path)"
                if self.path.is_dir()
                else ""
            )
            raise UserError(
                f"cannot open the lock file {self.path}: {exc.strerror}{remedy}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(
                f"{self.path.parent} is in use by another mileage run (pid {holder.get('pid', '?')} on "
                f"host {holder.get('host', '?')}, since {holder.get('since', '?')}); stop it or use another --save"
            ) from None
        holder = _read_holder(fd)
        self.previous_holder = holder or None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SaveDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
