"""Hands the trainer's weights to servers through the disk: an HF directory they reload from.

The directory is written with the `--save-hf` machinery (`write_hf_dir`: save_pretrained into
a staging name, then rename), so a server never reads half-written weights. Float32 weights go
through safetensors unchanged, so a server reloads exactly the trainer's tensors.
"""

from __future__ import annotations

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


class DiskWeights:
    """One directory, rewritten for every weight version."""

    def __init__(self, directory: str | None):
        self._temporary = directory is None
        root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="mileage-weights-"))
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.path = root / "current"

    def write(self, model: torch.nn.Module, tokenizer=None) -> Path:
        return write_hf_dir(model, tokenizer, self.path)

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)
