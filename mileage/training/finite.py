"""Non-finite values never reach a checkpoint.

A NaN or inf in a reward, a loss, a gradient or a weight spreads to every weight within one
optimizer step, and a checkpoint that holds it would become the tracked one (and, with
`--save-keep-last`, the only one). So the training step checks what it is about to apply, the
actor checks its weights after a rollout's steps, and the save path checks every tensor of a
checkpoint before it is committed; the first bad value stops the run with one line naming the
rollout and the quantity, and nothing of that rollout is saved.

miles' `--no-check-for-nan-in-loss-and-grad` is kept with its meaning: an optimizer step whose
loss or gradient is not finite is skipped instead (counted in the metrics as
`nonfinite_skipped`), up to `--max-nonfinite-skips` per run; weights are always checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from mileage import ranks
from mileage.config import option
from mileage.errors import UserError


class NonFiniteError(UserError):
    """A NaN or inf found before it could be applied or saved; `quantity` names what held it."""

    def __init__(self, quantity: str, detail: str):
        super().__init__(f"{quantity} is not finite: {detail}")
        self.quantity = quantity


@dataclass
class FiniteConfig:
    check_for_nan_in_loss_and_grad: bool = option(
        True,
        "skip (do not apply) an optimizer step whose loss or gradient is NaN/inf instead of "
        "stopping the run with exit 2 (miles' flag); skipped steps count as nonfinite_skipped",
        flag="--no-check-for-nan-in-loss-and-grad",
    )
    max_nonfinite_skips: int = option(
        8,
        "with --no-check-for-nan-in-loss-and-grad: stop (exit 2) once this many optimizer steps "
        "of the run have been skipped",
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (the check runs on every rank and is agreed by `ranks.any_rank`)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding a NaN or inf on this rank, or None."""
    for name, tensor in tensors:
        if tensor is None or not torch.is_floating_point(tensor):
            continue
        if not bool(torch.isfinite(_local(tensor)).all()):
            return name
    return None


def check_tensors(quantity: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise `NonFiniteError(quantity)` when any rank holds a non-finite tensor among `tensors`."""
    bad = first_nonfinite(tensors)
    if ranks.any_rank(bad is not None):
        raise NonFiniteError(quantity, f"{bad or 'a tensor on another rank'} holds NaN or inf")


def bad_stat(stats: Mapping[str, float]) -> str | None:
    """'name=value' of the first non-finite training statistic (the loss terms), or None."""
    for key, value in stats.items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}={value}"
    return None


def check_checkpoint(state) -> None:
    """Every tensor of a `CheckpointState` (model or adapter, optimizer, critic, old actors) is
    finite on every rank, or `NonFiniteError` names the part: called before each commit."""
    parts = [("weights", state.model), ("optimizer state", state.optimizer or {})]
    if state.critic is not None:
        parts += [
            ("critic weights", state.critic.model),
            ("critic optimizer state", state.critic.optimizer or {}),
        ]
    parts.append(("kept old-actor weights", state.old_actor))
    for quantity, tensors in parts:
        check_tensors(quantity, tensors.items())
