"""Where a native checkpoint directory's weights are: the iteration a step or the tracker names,
or release/, checked complete. Shared by the resume decision (plan.py) and the critic's
(critic_plan.py); every refusal names the flag, the path and the complete checkpoints there."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mileage.checkpoint.layout import (
    MANIFEST,
    TRACKER,
    CheckpointInfo,
    DirState,
    config_differences,
    inspect_checkpoint,
    scan_dir,
)
from mileage.errors import UserError


def list_complete(state: DirState) -> str:
    ids = state.complete_ids
    return ", ".join(str(i) for i in ids) if ids else "none"


def usable(info: CheckpointInfo | None, path: str, what: str, state: DirState) -> CheckpointInfo:
    if info is None:
        raise UserError(
            f"{what}: {path} does not exist; complete checkpoints in {state.path}: {list_complete(state)}"
        )
    if not info.complete:
        raise UserError(
            f"{what}: {path} is incomplete ({info.problem}); complete checkpoints in "
            f"{state.path}: {list_complete(state)}"
        )
    return info


@dataclass(frozen=True)
class Source:
    path: str
    fmt: str
    iteration: int | None
    info: CheckpointInfo | None  # None for HF directories
    reason: str


def native_source(state: DirState, step: int | None, flag: str) -> Source:
    """A weights-only source inside a native directory: iter_step, or what its tracker names."""
    if step is not None:
        path = os.path.join(state.path, f"iter_{step:07d}")
        info = usable(state.checkpoints.get(step), path, f"{flag} {step}", state)
        return Source(path, "native", step, info, f"{flag} {step} selects {path}")
    tracker = state.tracker
    if not tracker.valid:
        bad_tracker(state)
    if tracker.release:
        path = os.path.join(state.path, "release")
        info = usable(state.release, path, "tracker says release", state)
        return Source(
            path, "native", None, info, f"{state.path}: tracker says 'release', weights from {path}"
        )
    path = os.path.join(state.path, f"iter_{tracker.iteration:07d}")
    info = usable(
        state.checkpoints.get(tracker.iteration), path, f"tracker {state.path}/{TRACKER}", state
    )
    return Source(
        path,
        "native",
        tracker.iteration,
        info,
        f"tracker of {state.path} names iteration {tracker.iteration}",
    )


def bad_tracker(state: DirState) -> None:
    raise UserError(
        f"{os.path.join(state.path, TRACKER)} holds {state.tracker.raw!r}, which is neither a rollout "
        f"number nor 'release'; complete checkpoints there: {list_complete(state)}. Fix the file or "
        f"pass --ckpt-step; nothing was changed"
    )


def teacher_source(path: str, step: int | None, model_config: dict | None) -> Source:
    """Where `--opd-teacher-load` points: a Hugging Face model directory, a checkpoint directory
    (its tracker's iteration, or `step`), or one iter_N directory. A native teacher must be of
    the student's architecture (it loads into the student's config); another architecture goes
    in as an HF directory (`mileage export-hf`)."""
    flag = "--opd-teacher-load"
    if os.path.isfile(os.path.join(path, MANIFEST)):  # an iter_N or release directory itself
        if step is not None:
            raise UserError(
                f"{flag} {path} is one checkpoint; --opd-teacher-ckpt-step is for a run directory"
            )
        info = inspect_checkpoint(path)
        if not info.complete:
            raise UserError(f"{flag} {path} is incomplete ({info.problem})")
        source = Source(path, "native", info.meta.get("rollout_id"), info, f"{flag} {path}")
    else:
        state = scan_dir(path)
        if not state.exists:
            raise UserError(f"{flag} {path} does not exist")
        if state.is_native:
            source = native_source(state, step, "--opd-teacher-ckpt-step")
        elif state.is_hf:
            if step is not None:
                raise UserError(
                    f"{flag} {path} is a Hugging Face model directory; --opd-teacher-ckpt-step "
                    "is for a mileage checkpoint directory"
                )
            return Source(path, "hf", None, None, f"{flag} {path}")
        else:
            raise UserError(
                f"{flag} {path} is neither a Hugging Face model directory (config.json and "
                "weights) nor a mileage checkpoint directory"
            )
    saved = source.info.meta.get("model_config") if source.info is not None else None
    if saved is not None and model_config is not None:
        diffs = config_differences(saved, model_config)
        if diffs:
            raise UserError(
                f"{flag}: {source.path} is another architecture than the student's "
                f"({'; '.join(diffs)}); export it with `mileage export-hf` and pass that directory"
            )
    return source
