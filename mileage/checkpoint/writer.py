"""Saving on schedule, synchronously or in the background (`--async-save`).

At most one background save is in flight: a new save first waits for the previous one. The
tracker only moves when a save commits, so a crash during an async save leaves the previous
checkpoint as the latest. A failed background save is re-raised at the next `save`/`wait`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from mileage.checkpoint.schedule import SaveSchedule
from mileage.checkpoint.store import (
    CheckpointState,
    CheckpointWriteError,
    commit_checkpoint,
    prune_checkpoints,
)
from mileage.faults import fault_point


class CheckpointWriter:
    def __init__(
        self,
        save_dir: str | Path,
        keep_last: int | None = None,
        async_save: bool = False,
        on_commit: Callable[[int, Path], None] | None = None,
        schedule: SaveSchedule | None = None,
    ):
        self.save_dir = Path(save_dir)
        # when saves are due; None: after the last rollout only (the loop asks `due`)
        self.schedule = schedule
        self.keep_last = keep_last
        self.async_save = async_save
        self.on_commit = on_commit or (lambda rollout_id, path: None)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_snapshot: CheckpointState | None = None

    def due(self, rollout_id: int, num_rollout: int) -> bool:
        if self.schedule is None:
            return rollout_id == num_rollout - 1
        return self.schedule.due(rollout_id)

    def save(self, rollout_id: int, state: CheckpointState) -> None:
        if self.schedule is not None:
            self.schedule.saved()  # unsaved work is counted from here
        self.wait()
        if not self.async_save:
            self._commit(rollout_id, state)
            return
        snapshot = state.copied(reuse=self._last_snapshot)
        self._last_snapshot = snapshot  # written by then: the next save waits for this one
        self._thread = threading.Thread(
            target=self._commit_in_background,
            args=(rollout_id, snapshot),
            name="mileage-save",
            daemon=True,
        )
        self._thread.start()

    def _commit(self, rollout_id: int, state: CheckpointState) -> None:
        path = commit_checkpoint(self.save_dir, rollout_id, state)
        try:
            prune_checkpoints(self.save_dir, self.keep_last)
            fault_point("save_after_prune", self.save_dir)
        except OSError as exc:
            raise CheckpointWriteError(
                f"saving checkpoint {path.name}: it is committed, but removing older checkpoints "
                f"(--save-keep-last) failed: {exc.strerror or exc} ({exc.filename or self.save_dir})"
            ) from None
        self.on_commit(rollout_id, path)

    def _commit_in_background(self, rollout_id: int, state: CheckpointState) -> None:
        try:
            self._commit(rollout_id, state)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = exc

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has committed; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
