"""Sharded checkpoints: every rank writes its shards, rank 0 commits.

The commit stays one step (see `mileage/checkpoint/store.py`):
  1. rank 0 creates the staging directory and tells every rank its name;
  2. every rank writes its model and optimizer shards into it through DCP (`dcp.save` is
     collective: rank 0 writes `.metadata` only after all ranks' files are written); with PPO
     then the critic's model and optimizer shards, into critic/ of the same directory;
  3. rank 0 writes the critic's meta (PPO), the RNG states of all ranks, the trainer state and meta.json, fsyncs and
     hashes every file (all ranks' shards included) into the manifest, renames the directory and
     moves the tracker; then it tells every rank the outcome.
A rank that dies anywhere before step 3's rename leaves only a staging directory, which the next
start removes; torchrun stops the other ranks. Rank 0 reads the shards of the other ranks from
the same file system, so on several nodes --save must be on a shared file system.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import torch

from mileage.checkpoint.layout import CRITIC_DIR
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
    """`CheckpointWriter` whose every save involves all ranks.

    `--async-save`: as torchtitan does with `dcp.async_save`, each save is first staged on the
    main thread by DCP's own stager (a CPU copy of every rank's shards, DTensors kept, buffers
    reused from save to save), then written by a background thread on every rank whose
    collectives run on a gloo group of their own, never on training's. mileage runs DCP's
    save itself in that thread rather than calling `dcp.async_save` once per directory: each
    call would start its own thread, and the model, optimizer and critic directories would then
    run their collectives concurrently on one group, in an order that can differ between ranks.
    The commit (rank 0) and its outcome follow in the same thread, so the tracker still moves
    once, after every rank's shards are written; a failure reaches every rank at the next save
    or at the end of the run.
    """

    def __init__(self, save_dir, keep_last=None, async_save=False, on_commit=None, schedule=None):
        super().__init__(save_dir, keep_last, async_save, on_commit, schedule)
        self._group = None
        self._stager = None
        if async_save:
            import torch.distributed as dist
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # a collective: every rank builds its writer in build_run
            self._group = dist.new_group(backend="gloo")
            # a plain synchronous CPU copy (no pinned or shared memory, no CUDA stream)
            self._stager = DefaultStager(StagingOptions(False, False, False, False))

    def save(self, rollout_id: int, state: CheckpointState) -> None:
        self.wait()
        if not self.async_save:
            self._commit(rollout_id, state)
            return
        # the RNG states are gathered here, on the main thread's group, with the other ranks
        snapshot = self._staged(replace(state, rng=gather_rng(state.rng)))
        self._thread = threading.Thread(
            target=self._commit_in_background,
            args=(rollout_id, snapshot),
            name="mileage-save",
            daemon=True,
        )
        self._thread.start()

    def _staged(self, state: CheckpointState) -> CheckpointState:
        """A copy training cannot change: tensors through DCP's stager (the previous save's
        buffers, which it has finished writing), the JSON parts through a round trip."""

        def stage(tensors):
            return None if tensors is None else dict(self._stager.stage(dict(tensors)))

        return CheckpointState(
            model=stage(state.model),
            meta=json.loads(json.dumps(state.meta)),
            optimizer=stage(state.optimizer),
            rng={k: v.clone() for k, v in state.rng.items()},
            trainer=json.loads(json.dumps(state.trainer)),
            critic=self._staged(state.critic) if state.critic is not None else None,
        )

    def _commit(self, rollout_id: int, state: CheckpointState) -> None:
        background = self._group is not None
        path = commit_sharded(
            self.save_dir, rollout_id, state, group=self._group, rng_gathered=background
        )
        failure = None
        if env.is_main():
            try:
                prune_checkpoints(self.save_dir, self.keep_last)
                fault_point("save_after_prune", self.save_dir)  # as in the one-process writer
                self.on_commit(rollout_id, path)
            except (OSError, UserError) as exc:
                failure = (
                    exc
                    if isinstance(exc, UserError)
                    else CheckpointWriteError(
                        f"saving checkpoint {path.name}: it is committed, but removing older "
                        f"checkpoints (--save-keep-last) failed: {exc}"
                    )
                )
        failure = _broadcast(failure, self._group)
        if failure is not None:
            raise failure


def _broadcast(value, group=None):
    """Rank 0's `value` on every rank of `group` (the whole world's by default)."""
    if not env.is_distributed():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _all_gather(value, group=None) -> list:
    if not env.is_distributed():
        return [value]
    import torch.distributed as dist

    out = [None] * env.world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def commit_sharded(
    save_dir: Path, name: int, state: CheckpointState, group=None, rng_gathered: bool = False
) -> Path:
    """Write this rank's shards of `state`; rank 0 commits. Returns the committed path.

    `group`: the process group of every collective here (a background save's own);
    `rng_gathered`: `state.rng` already holds every rank's RNG states (`gather_rng`)."""
    staging = None
    if env.is_main():
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            staging = staging_path(save_dir, name)
            staging.mkdir()
        except OSError as exc:
            staging = CheckpointWriteError(f"saving checkpoint {name} failed: {exc}")
    staging = _broadcast(staging, group)
    if isinstance(staging, CheckpointWriteError):
        raise staging
    try:
        save_tensors(state.model, staging / MODEL_DIR, group)
        fault_point("save_after_model", staging)
        if state.optimizer is not None:
            save_tensors(state.optimizer, staging / OPTIMIZER_DIR, group)
            fault_point("save_after_optimizer", staging)
        if state.critic is not None:  # PPO: the critic's shards, in the same staging directory
            critic = staging / CRITIC_DIR  # DCP's writer creates it (parents included)
            save_tensors(state.critic.model, critic / MODEL_DIR, group)
            fault_point("save_after_critic_model", critic)
            save_tensors(state.critic.optimizer, critic / OPTIMIZER_DIR, group)
        failure = None
    except Exception as exc:  # noqa: BLE001 - DCP wraps each rank's OSError; all ranks see it
        failure = f"saving checkpoint {name} failed while writing shards: {exc}"
    failures = [f for f in _all_gather(failure, group) if f]
    if failures:
        if env.is_main():
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(
            f"{failures[0]}; the previous checkpoint and the tracker are untouched"
        )
    rng = state.rng if rng_gathered else gather_rng(state.rng)
    outcome: Path | CheckpointWriteError
    if env.is_main():
        try:
            outcome = commit_checkpoint(save_dir, name, replace(state, rng=rng), staging=staging)
        except CheckpointWriteError as exc:
            outcome = exc
    else:
        outcome = None
    outcome = _broadcast(outcome, group)
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
