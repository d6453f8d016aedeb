"""A checkpoint's meta.json: what it is, what produced it, and which model it was trained from.

The model source lets `mileage export-hf` and raw mode find the architecture and tokenizer of a
checkpoint without the user knowing cache paths: an HF directory (recorded as an absolute path)
or a built-in model (recorded with its task, so it can be rebuilt bit for bit on another machine).
"""

from __future__ import annotations

import json
import platform
import socket
import time
from pathlib import Path

import torch
import transformers

import mileage
from mileage import ranks
from mileage.checkpoint.layout import (
    META,
    architecture,
    checkpoint_path,
    fingerprint,
    read_tracker,
)
from mileage.errors import UserError

MODEL_SOURCE = "model_source"


def model_source(hf_checkpoint: str | Path, builtin_task: str | None) -> dict:
    """The meta.json record of what a run was trained from (`builtin_task` None for HF dirs)."""
    return {"hf_checkpoint": str(Path(hf_checkpoint).resolve()), "builtin_task": builtin_task}


def checkpoint_meta(
    model_config: dict, rollout_id: int | None, source: dict | None, **extra
) -> dict:
    meta = {
        "kind": "iteration" if rollout_id is not None else "release",
        "rollout_id": rollout_id,
        "next_rollout_id": None if rollout_id is None else rollout_id + 1,
        "world_size": ranks.world_size(),
        "model_config": architecture(model_config),
        "model_config_fingerprint": fingerprint(model_config),
        MODEL_SOURCE: source,
        "versions": {
            "mileage": mileage.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    meta.update(extra)
    return meta


def selected_checkpoint(save_dir: str | Path, step: int | None, step_flag: str) -> Path:
    """iter_`step`, or what the tracker of `save_dir` names; one-line errors otherwise."""
    if step is not None:
        return checkpoint_path(save_dir, step)
    if not Path(save_dir).is_dir():
        raise UserError(f"{save_dir} does not exist or is not a directory")
    tracker = read_tracker(save_dir)
    if not tracker.valid:
        raise UserError(f"{save_dir} has no valid tracker; pass {step_flag}")
    return checkpoint_path(save_dir, "release" if tracker.release else tracker.iteration)


def recorded_source(checkpoint: str | Path) -> dict | None:
    """The model source in `checkpoint`'s meta.json; None if it predates the record."""
    file = Path(checkpoint) / META
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{file} does not exist; is {checkpoint} a mileage checkpoint?") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{file} is unreadable ({exc})") from None
    source = meta.get(MODEL_SOURCE) if isinstance(meta, dict) else None
    return source if isinstance(source, dict) else None


def recorded_lora(checkpoint: str | Path) -> dict | None:
    """The `lora` entry of a checkpoint's meta.json (adapter shape and base); None for full
    weights or an unreadable meta.json (whose problem is reported where it is read)."""
    try:
        meta = json.loads((Path(checkpoint) / META).read_text())
    except (OSError, ValueError):
        return None
    entry = meta.get("lora") if isinstance(meta, dict) else None
    return entry if isinstance(entry, dict) else None


def recorded_micro_batch(checkpoint: str | Path) -> int | None:
    """The micro-batch (samples) the run that wrote `checkpoint` trained with; None where its
    meta.json predates the record or is unreadable (reported where it is read)."""
    try:
        meta = json.loads((Path(checkpoint) / META).read_text())
    except (OSError, ValueError):
        return None
    value = meta.get("micro_batch_size") if isinstance(meta, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def recorded_model_dir(checkpoint: str | Path, log) -> str:
    """The HF directory (config + tokenizer) `checkpoint` was trained from, as meta.json records it.

    A built-in model missing from this machine's cache is rebuilt (deterministically, bit for bit).
    """
    source = recorded_source(checkpoint)
    if source is None:
        raise UserError(
            f"{Path(checkpoint) / META} does not record the model it was trained from "
            "(saved by an older mileage); pass --hf-checkpoint"
        )
    path = Path(source.get("hf_checkpoint") or "")
    task = source.get("builtin_task")
    if task and not (path / "config.json").is_file():
        from mileage.rollout.builtin_model import ensure_builtin_model

        path = ensure_builtin_model(task, log=log)
    elif not path.is_dir():
        raise UserError(
            f"{checkpoint} was trained from {path}, which no longer exists; pass --hf-checkpoint"
        )
    what = f"the built-in {task} model, " if task else ""
    log(f"config and tokenizer from {what}{path} (as recorded in {Path(checkpoint) / META})")
    return str(path)
