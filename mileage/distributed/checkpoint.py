"""Sharded checkpoints: every rank writes its shards, rank 0 commits.

The commit stays one step (see `mileage/checkpoint/store.py`):
  1. rank 0 creates the staging directory and tells every rank its name;
  2. every rank writes its model and optimizer shards into it through DCP (`dcp.save` is
     collective: rank 0 writes `.metadata` only after all ranks' files are written);
  3. rank 0 writes the RNG states of all ranks, the trainer state and meta.json, fsyncs and
     hashes every file (all ranks' shards included) into the manifest, renames the directory and
     moves the tracker; then it tells every rank the outcome.
A rank that dies anywhere before step 3's rename leaves only a staging directory, which the next
start removes; torchrun stops the other ranks. Rank 0 reads the shards of the other ranks from
the same file system, so on several nodes --save must be on a shared file system.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from mileage.checkpoint.store import (
    CheckpointState,
    CheckpointWriteError,
    commit_checkpoint,
    prune_checkpoints,
    staging_path,
)
from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR, save_tensors
from mileage.checkpoint.writer import CheckpointWriter
from mileage.distributed import env
from mileage.errors import UserError
from mileage.faults import fault_point

# rng.safetensors keys of rank r > 0 are prefixed with this and r (rank 0's keep their names,
# so that a single-process run reads its own state from a sharded checkpoint)
RANK_PREFIX = "rank"


class ShardedCheckpointWriter(CheckpointWriter):
    """`CheckpointWriter` whose every save involves all ranks (synchronous only)."""

    def __init__(self, save_dir, keep_last=None, async_save=False, on_commit=None):
        if async_save:
            raise UserError(
                "--async-save is not supported under torchrun yet (a background save would run "
                "collectives beside training's); drop it"
            )
        super().__init__(save_dir, keep_last, False, on_commit)

    def _commit(self, rollout_id: int, state: CheckpointState) -> None:
        path = commit_sharded(self.save_dir, rollout_id, state)
        if env.is_main():
            prune_checkpoints(self.save_dir, self.keep_last)
            fault_point("save_after_prune", self.save_dir)  # as in the one-process writer
            self.on_commit(rollout_id, path)
        env.barrier()


def commit_sharded(save_dir: Path, name: int, state: CheckpointState) -> Path:
    """Write this rank's shards of `state`; rank 0 commits. Returns the committed path."""
    staging = None
    if env.is_main():
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            staging = staging_path(save_dir, name)
            staging.mkdir()
        except OSError as exc:
            staging = CheckpointWriteError(f"saving checkpoint {name} failed: {exc}")
    staging = env.broadcast_object(staging)
    if isinstance(staging, CheckpointWriteError):
        raise staging
    try:
        save_tensors(state.model, staging / MODEL_DIR)
        fault_point("save_after_model", staging)
        if state.optimizer is not None:
            save_tensors(state.optimizer, staging / OPTIMIZER_DIR)
            fault_point("save_after_optimizer", staging)
        failure = None
    except Exception as exc:  # noqa: BLE001 - DCP wraps each rank's OSError; all ranks see it
        failure = f"saving checkpoint {name} failed while writing shards: {exc}"
    failures = [f for f in env.all_gather_object(failure) if f]
    if failures:
        if env.is_main():
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(
            f"{failures[0]}; the previous checkpoint and the tracker are untouched"
        )
    rng = gather_rng(state.rng)
    outcome: Path | CheckpointWriteError
    if env.is_main():
        try:
            outcome = commit_checkpoint(save_dir, name, replace(state, rng=rng), staging=staging)
        except CheckpointWriteError as exc:
            outcome = exc
    else:
        outcome = None
    outcome = env.broadcast_object(outcome)
    if isinstance(outcome, CheckpointWriteError):
        raise outcome
    return outcome


def gather_rng(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's global RNG tensors in one dict (rank 0's under their own names)."""
    merged: dict[str, torch.Tensor] = {}
    for index, part in enumerate(env.all_gather_object(tensors)):
        for key, value in part.items():
            merged[key if index == 0 else f"{RANK_PREFIX}{index}.{key}"] = value
    return merged


def rng_of_this_rank(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's RNG tensors from a checkpoint; rank 0's when it was saved by fewer ranks."""
    prefix = f"{RANK_PREFIX}{env.rank()}."
    own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if own:
        return own
    return {k: v for k, v in tensors.items() if not k.startswith(RANK_PREFIX)}
