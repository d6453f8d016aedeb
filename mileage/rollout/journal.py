"""The tool journal: every tool call's outcome, appended and fsynced before the trajectory
goes on, so a rerun of an interrupted rollout reads it back instead of calling the tool again.

Tools are user code and need not be deterministic (a web search, a clock, a sandbox). A run
killed halfway through a rollout regenerates that rollout from its last checkpoint; with the
journal the regenerated trajectories get exactly the outputs the killed run got (the model's
tokens are exact already), so they are the same trajectories, and the run continues bit for bit.

Layout: `{save}/tool_journal/slot_{N}.jsonl`, one file per generation slot (rollout id; async
and dynamic sampling slots), one JSON line per call keyed by (slot, prompt position, sample
index, turn, call in turn). An entry is used only if the recorded request (tool name and
arguments) equals the new one, so a journal can never hand a trajectory an output it did not
ask for. A torn last line (a kill inside a write) is ignored: that call is made again. Every
line carries a checksum of its entry; a line that fails it (a flipped byte on disk), or a line
that is not JSON before the last, is refused in one line when the run starts (`check`), as a
damaged checkpoint is: the journal is part of what makes the resume exact.

Pruning follows the checkpoint: slots below the one a run starts from can never be generated
again, so `prune(start)` deletes their files when the run starts (after the plan chose its
checkpoint) and after each committed save. A fresh start (no checkpoint) clears the journal.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from mileage.errors import UserError

JOURNAL_DIR = "tool_journal"
CHECKSUM = "sha256"  # of the entry's other fields, as sorted-key JSON; absent in old journals
BATCH = "batch"  # a line of several entries (an agent's completions of one engine call)


def entry_checksum(entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def read_entries(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of one slot's file, by key. A torn last line (no newline: a kill inside its
    write) is left out; any other line that is not JSON or fails its checksum is refused."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    entries: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        torn = number == len(lines)  # the text after the last newline
        try:
            entry = json.loads(line)
            ok = isinstance(entry, dict) and entry.get(CHECKSUM, None) in (
                None,
                entry_checksum(entry),
            )
        except json.JSONDecodeError:
            ok = False
        if not ok and torn:
            continue  # that call is made again
        if not ok:
            raise UserError(
                f"the tool journal {path} is damaged at line {number} (not the entry that was "
                "written); delete the file to call those tools again (their rollout is then not "
                "the killed run's), or restore it from a copy"
            )
        # a batch line holds one engine call's completions, written at once (all or none)
        for item in entry.get(BATCH, [entry]):
            entries[item["key"]] = item
    return entries


def call_key(slot: int, prompt: int, sample: int, turn: int, call: int) -> str:
    return f"{slot}/{prompt}/{sample}/{turn}/{call}"


class ToolJournal:
    """Append-only, fsynced record of tool outcomes in `directory` (None: nothing is kept, for
    runs without --save, which cannot resume anyway)."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory is not None else None
        self._loaded: dict[int, dict[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()  # train-async generates in a thread
        self.replayed = 0  # calls answered from the journal (for tests and logs)

    def _path(self, slot: int) -> Path:
        assert self.directory is not None
        return self.directory / f"slot_{slot}.jsonl"

    def _entries(self, slot: int) -> dict[str, dict[str, Any]]:
        if slot not in self._loaded:
            entries: dict[str, dict[str, Any]] = {}
            if self.directory is not None and self._path(slot).is_file():
                entries = read_entries(self._path(slot))
            self._loaded[slot] = entries
        return self._loaded[slot]

    def lookup(
        self, slot: int, key: str, name: str, arguments: dict[str, Any]
    ) -> tuple[str, str] | None:
        """(status, output) recorded for this call, or None to call the tool."""
        with self._lock:
            entry = self._entries(slot).get(key)
            if entry is None or entry["name"] != name or entry["arguments"] != arguments:
                return None
            self.replayed += 1
            return entry["status"], entry["output"]

    def record(
        self, slot: int, key: str, name: str, arguments: dict[str, Any], status: str, output: str
    ) -> None:
        """Append the call's outcome durably (fsync) before the trajectory uses it."""
        entry = {
            "key": key,
            "name": name,
            "arguments": arguments,
            "status": status,
            "output": output,
        }
        entry[CHECKSUM] = entry_checksum(entry)
        if self.directory is None:
            return  # a run without --save cannot resume: nothing would ever read it back
        with self._lock:
            self._entries(slot)[key] = entry
            self._append(slot, entry)

    def _append(self, slot: int, entry: dict[str, Any]) -> None:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        fd = os.open(self._path(slot), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, slot: int, key: str) -> dict[str, Any] | None:
        """The entry recorded under `key` in `slot` (None: none), for callers that compare the
        request themselves (an agent's completions: mileage.rollout.agents.session)."""
        with self._lock:
            return self._entries(slot).get(key)

    def record_batch(self, slot: int, entries: list[dict[str, Any]]) -> None:
        """Append `entries` (each with a "key") as ONE fsynced line: a kill inside the write
        loses all of them, so a rerun regenerates the engine call whole, as it was batched."""
        if self.directory is None or not entries:
            return
        line_entry: dict[str, Any] = {BATCH: entries}
        line_entry[CHECKSUM] = entry_checksum(line_entry)
        with self._lock:
            for entry in entries:
                self._entries(slot)[entry["key"]] = entry
            self._append(slot, line_entry)

    def check(self) -> None:
        """Read every slot's file now (kept for the lookups), so a damaged one stops the run
        before it trains."""
        with self._lock:
            for slot in sorted(self._slots()):
                self._entries(slot)

    def prune(self, below: int) -> None:
        """Delete the entries of slots < `below` (they are in a committed checkpoint's past)."""
        with self._lock:
            self._loaded = {s: e for s, e in self._loaded.items() if s >= below}
            for slot in self._slots():
                if slot < below:
                    self._path(slot).unlink(missing_ok=True)

    def _slots(self) -> list[int]:
        """The slots that have a file in the journal's directory."""
        if self.directory is None or not self.directory.is_dir():
            return []
        slots = []
        for path in self.directory.glob("slot_*.jsonl"):
            try:
                slots.append(int(path.stem.removeprefix("slot_")))
            except ValueError:
                continue
        return slots
