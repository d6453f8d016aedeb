"""Graceful stop on SIGTERM/SIGINT and on a save-trigger sentinel file.

The first signal asks the loop to finish the current rollout, save, and exit with STOPPED_EXIT
(75, sysexits' EX_TEMPFAIL: "try again"), so that `mileage train ... && mileage export-hf ...`
does not go on with an unfinished model and a scheduler can requeue the job. A second signal
exits at once: checkpoints are committed atomically, so an abrupt exit can only leave a staging
directory behind, which the next start removes.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# the exit code of a run stopped early by a signal, saved and resumable by the same command
STOPPED_EXIT = 75


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SIGNAL_NAMES = frozenset(s.name for s in SIGNALS)

    def __init__(self, sentinel: str | None = None):
        self.sentinel = Path(sentinel) if sentinel else None
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            print(
                f"\nmileage: second {name}, exiting now (the last committed checkpoint is intact)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        self.signal_name = name
        print(
            f"\nmileage: {name} received; finishing this rollout, then saving and exiting "
            f"(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    @property
    def stop_requested(self) -> bool:
        return self.signal_name is not None

    def sentinel_present(self) -> bool:
        return self.sentinel is not None and self.sentinel.exists()

    def clear_sentinel(self) -> None:
        if self.sentinel is not None:
            self.sentinel.unlink(missing_ok=True)

    def __enter__(self) -> PreemptionGuard:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
