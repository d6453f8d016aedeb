"""Durable file primitives for checkpoints: fsync, JSON written and synced, sha256, read-ahead.

Everything a commit relies on to survive a power cut goes through here (`store.py` says in
which order).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def prefetch(paths: Iterable[Path]) -> None:
    """Ask the kernel to start reading these files into the page cache, without waiting.

    A load alternates reading with CPU work (hashing, copying into tensors); with the reads
    queued up front the disk streams at full speed while the CPU works.
    """
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # the load itself reports missing files
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advice only
        finally:
            os.close(fd)


def prefetch_checkpoint(checkpoint: str | Path) -> None:
    prefetch(sorted(p for p in Path(checkpoint).rglob("*") if p.is_file()))
