"""Hands the trainer's weights to servers through the disk: an HF directory they reload from.

The directory is written with the `--save-hf` machinery (`write_hf_dir`: save_pretrained into
a staging name, then rename), so a server never reads half-written weights. Float32 weights go
through safetensors unchanged, so a server reloads exactly the trainer's tensors.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from mileage.models.hf import write_hf_dir


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
