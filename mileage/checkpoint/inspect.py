"""Read-only views of a save directory: the listing behind `mileage ckpt ls` and `ckpt verify`."""

from __future__ import annotations

from pathlib import Path

from mileage.checkpoint.layout import RELEASE, TRACKER, checkpoint_path, scan_dir
from mileage.errors import UserError

# store and tensors import torch (~1 s); they are imported where tensors are read, so that
# `mileage ckpt ls` of a directory without complete checkpoints lists it without them


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _digest(directory: Path) -> str | None:
    from mileage.checkpoint.tensors import load_tensors, tensor_digest

    return tensor_digest(load_tensors(directory)) if (directory / ".metadata").is_file() else None


def list_checkpoints(save_dir: str | Path, digests: bool = True) -> list[dict]:
    """One entry per iter_N / release directory, oldest first."""
    state = scan_dir(save_dir)
    if not state.exists:
        raise UserError(f"{save_dir} does not exist")
    tracker = state.tracker
    entries = [(RELEASE, state.release)] if state.release is not None else []
    entries += sorted(state.checkpoints.items())
    rows = []
    for rollout_id, info in entries:
        path = Path(info.path)
        row = {
            "name": path.name,
            "rollout_id": None if rollout_id == RELEASE else rollout_id,
            "size_bytes": _size(path),
            "complete": info.complete,
            "problem": info.problem or None,
            "tracked": tracker.release
            if rollout_id == RELEASE
            else tracker.iteration == rollout_id,
            "model_digest": None,
            "optimizer_digest": None,
        }
        if digests and info.complete:
            from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR

            row["model_digest"] = _digest(path / MODEL_DIR)
            row["optimizer_digest"] = _digest(path / OPTIMIZER_DIR)
        rows.append(row)
    return rows


def verify_save_dir(
    save_dir: str | Path, ckpt_step: int | None = None
) -> tuple[list[str], list[str]]:
    """(checked checkpoint names, problems). Checks the tracker too when no step is given."""
    from mileage.checkpoint.store import verify_checkpoint

    state = scan_dir(save_dir)
    if not state.exists:
        raise UserError(f"{save_dir} does not exist")
    problems: list[str] = []
    if ckpt_step is not None:
        targets = [checkpoint_path(save_dir, ckpt_step)]
        if not targets[0].is_dir():
            raise UserError(f"{targets[0]} does not exist")
    else:
        targets = [Path(c.path) for _, c in sorted(state.checkpoints.items())]
        if state.release is not None:
            targets.append(Path(state.release.path))
        tracker = state.tracker
        if tracker.exists and not tracker.valid:
            problems.append(f"{Path(save_dir) / TRACKER}: invalid content {tracker.raw!r}")
        elif tracker.iteration is not None and tracker.iteration not in state.complete_ids:
            problems.append(
                f"{Path(save_dir) / TRACKER}: names iteration {tracker.iteration}, which is not complete"
            )
    for target in targets:
        problems += verify_checkpoint(target)
    return [t.name for t in targets], problems
