"""Hands the trainer's weights to servers through the disk: an HF directory they reload from.

The directory is written with the `--save-hf` machinery (`write_hf_dir`: save_pretrained into
a staging name, then rename), so a server never reads half-written weights. Float32 weights go
through safetensors unchanged, so a server reloads exactly the trainer's tensors.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mileage.models.hf import write_atomically, write_hf_dir


def write_hf_weights(config: Any, tensors: dict[str, torch.Tensor], out: Path) -> Path:
    """An HF model directory (config + one safetensors file) at `out`, replaced atomically:
    full values gathered from the shards (HF names), where no plain model holds them."""

    def write(staging: Path) -> None:
        config.save_pretrained(staging)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

    return write_atomically(out, write)


# A temporary weights directory is named after the process that writes it, so that the next
# run can remove what a killed one left (a full copy of the weights: 15 GB for a 7B model).
TEMPORARY_PREFIX = "mileage-weights-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_orphaned_weights(parent: Path | None = None) -> list[Path]:
    """Remove this user's temporary weights directories whose writing process has exited (a
    killed run cannot clean up after itself); a live writer's directory, or another user's,
    is left alone. Returns what was removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for path in parent.glob(TEMPORARY_PREFIX + "*"):
        pid = path.name[len(TEMPORARY_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.is_symlink():
            continue  # an older run's unstamped name, or not ours to judge
        try:
            if path.stat().st_uid != os.getuid() or _alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class DiskWeights:
    """One directory, rewritten for every weight version: `directory` (--rollout-weights-dir),
    kept, or a temporary one made at the first write and removed by `close` (or, after a kill,
    by the next run's `remove_orphaned_weights`)."""

    def __init__(self, directory: str | None):
        self._given = Path(directory) if directory else None
        self._root: Path | None = None

    @property
    def root(self) -> Path:
        if self._root is None:
            if self._given is not None:
                self._given.mkdir(parents=True, exist_ok=True)
                self._root = self._given
            else:
                remove_orphaned_weights()
                prefix = f"{TEMPORARY_PREFIX}{os.getpid()}-"
                self._root = Path(tempfile.mkdtemp(prefix=prefix))
        return self._root

    @property
    def path(self) -> Path:
        return self.root / "current"

    def write(self, model: torch.nn.Module, tokenizer=None) -> Path:
        return write_hf_dir(model, tokenizer, self.path)

    def close(self) -> None:
        if self._given is None and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
