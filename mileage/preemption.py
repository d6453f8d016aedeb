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
import threading
from pathlib import Path

# the exit code of a run stopped early by a signal, saved and resumable by the same command
STOPPED_EXIT = 75


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SIGNAL_NAMES = frozenset(s.name for s in SIGNALS)

    def __init__(self, sentinel: str | None = None, grace: float = 0.0):
        self.sentinel = Path(sentinel) if sentinel else None
        self.signal_name: str | None = None
        self._previous: dict = {}
        # --stop-grace-seconds: the first signal's wait for the rollout is bounded (0: unbounded)
        self.grace = grace
        self._grace_timer: threading.Timer | None = None

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
        if self.grace:
            self._grace_timer = threading.Timer(self.grace, self._grace_over)
            self._grace_timer.daemon = True
            self._grace_timer.start()
        print(
            f"\nmileage: {name} received; finishing this rollout, then saving and exiting "
            f"(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def _grace_over(self) -> None:
        """The rollout in flight did not reach its save in time (a hung engine, say): leave
        without it. Commits are atomic, so the last committed checkpoint is what a rerun finds."""
        print(
            f"\nmileage: {self.signal_name}: the rollout did not finish within {self.grace:g} s "
            "(--stop-grace-seconds); exiting without saving it. The last committed checkpoint is "
            "intact: rerun the same command to resume from it",
            file=sys.stderr,
            flush=True,
        )
        os._exit(STOPPED_EXIT)

    def reached_save(self) -> None:
        """The loop is at the rollout's end and about to save: the grace period is over."""
        if self._grace_timer is not None:
            self._grace_timer.cancel()

    @property
    def stop_requested(self) -> bool:
        if self.signal_name is not None:
            self.reached_save()
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
