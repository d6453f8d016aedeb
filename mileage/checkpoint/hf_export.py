"""Crossing between native checkpoints and Hugging Face directories.

`write_release` makes SAVE/release from HF weights (`mileage convert`, the raw-mode starting
point); `export_hf` writes a native checkpoint's weights as an HF directory (`--save-hf`,
`mileage export-hf`). Both write to a temporary name and rename, so a reader never sees half.
"""

from __future__ import annotations

from pathlib import Path

from mileage.checkpoint.layout import RELEASE, scan_dir
from mileage.checkpoint.meta import checkpoint_meta, model_source
from mileage.checkpoint.store import CheckpointState, commit_checkpoint, verify_checkpoint
from mileage.checkpoint.tensors import load_model_weights, model_tensors
from mileage.errors import UserError
from mileage.models.hf import (
    empty_causal_lm,
    load_causal_lm,
    load_tokenizer,
    read_config_json,
    write_hf_dir,
)


def write_release(hf_checkpoint: str | Path, save_dir: str | Path) -> Path:
    """SAVE/release + tracker 'release' from an HF model: weights only, nothing to resume."""
    state = scan_dir(save_dir)
    if state.exists and (state.checkpoints or state.tracker.exists):
        raise UserError(
            f"{save_dir} already holds checkpoints or a tracker; convert into an empty directory"
        )
    model = load_causal_lm(hf_checkpoint)
    meta = checkpoint_meta(
        read_config_json(hf_checkpoint), rollout_id=None, source=model_source(hf_checkpoint, None)
    )
    return commit_checkpoint(
        save_dir, RELEASE, CheckpointState(model=model_tensors(model), meta=meta)
    )


def export_hf(checkpoint: str | Path, hf_checkpoint: str | Path, out: str | Path) -> Path:
    """Weights of a native checkpoint + config/tokenizer of `hf_checkpoint` -> an HF directory."""
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise UserError(f"checkpoint {checkpoint} is not usable: {problems[0]}")
    tokenizer = load_tokenizer(hf_checkpoint)
    model = empty_causal_lm(hf_checkpoint)
    load_model_weights(checkpoint, model)
    return write_hf_dir(model, tokenizer, out)
