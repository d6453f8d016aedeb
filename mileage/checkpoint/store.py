"""Writing, committing, loading and verifying checkpoints.

Commit order (a kill at any instant leaves the tracker absent or naming a complete checkpoint).
Each gap has a named fault point (`mileage.faults`), so the tests can kill or fail a save there:
  1. write everything under SAVE/.staging-<name>-<pid>-<n>/: model [save_after_model],
     optimizer [save_after_optimizer], with PPO the critic's model [save_after_critic_model],
     optimizer and meta [save_after_critic] (inside the same staging directory, so the one
     rename and tracker below commit actor and critic together), RNG, train-async's kept old-actor weights,
     trainer state and meta [save_after_state]; fsync
     each file while hashing it [save_before_manifest]; then the manifest [commit_before_rename];
  2. rename the staging directory to iter_{N:07d} [commit_after_rename] and fsync SAVE
     [commit_before_tracker];
  3. replace the tracker atomically: temp file, fsync [tracker_before_replace], rename, fsync
     SAVE [commit_after_tracker].
Only then are old checkpoints pruned (`--save-keep-last`) [save_after_prune], never the one the
tracker names; a pruned directory is first renamed to a staging name, so a kill mid-delete
leaves a leftover for the next start to remove, not a half-deleted checkpoint.

Model and optimizer tensors are stored with torch.distributed.checkpoint (DCP), keyed by
parameter name, so they reshard to another world size. Only tensors go into DCP: DCP unpickles
non-tensor entries with `weights_only=False`, so optimizer hyper-parameters, counters and data
position live in JSON instead.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mileage.checkpoint.files import (
    file_sha256,
    fsync_path,
    prefetch,
    write_json_durably,
)
from mileage.checkpoint.layout import (
    CRITIC_DIR,
    MANIFEST,
    META,
    RELEASE,
    STAGING_PREFIX,
    TRACKER,
    checkpoint_path,
    inspect_checkpoint,
    iter_dir_name,
    read_tracker,
    scan_dir,
)
from mileage.checkpoint.tensors import (
    MODEL_DIR,
    OLD_ACTOR_FILE,
    OPTIMIZER_DIR,
    RNG_FILE,
    save_safetensors,
    save_tensors,
)
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.seeding import overwritten_allocations

TRAINER_STATE = "trainer_state.json"


class CheckpointWriteError(UserError):
    """Saving failed (disk full, I/O error, permissions...); the previous checkpoint is intact."""

    exit_code = 1


@dataclass
class CheckpointState:
    """Everything one checkpoint holds, already detached from live objects."""

    model: dict[str, torch.Tensor]
    meta: dict
    optimizer: dict[str, torch.Tensor] | None = None
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    # PPO: the critic's model, optimizer and meta, written to critic/ of the same checkpoint
    critic: CheckpointState | None = None
    # train-async --keep-old-actor: "<version>/<name>" -> the weights buffered groups came from
    old_actor: dict[str, torch.Tensor] = field(default_factory=dict)

    def copied(self, reuse: CheckpointState | None = None) -> CheckpointState:
        """A deep copy in CPU memory, so training can go on while a background thread writes.

        Tensors are copied into `reuse`'s buffers where name, shape and dtype match (the
        previous snapshot, once its write is done): freshly allocated memory is first touched
        page by page during the copy, which made it about twice as slow.
        """

        def clone(tensors, old):
            if tensors is None:
                return None
            old = old or {}
            out = {}
            with overwritten_allocations():
                for name, value in tensors.items():
                    buffer = old.get(name)
                    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                        buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu")
                    out[name] = buffer.copy_(value.detach())
            return out

        return CheckpointState(
            clone(self.model, reuse and reuse.model),
            json.loads(json.dumps(self.meta)),
            clone(self.optimizer, reuse and reuse.optimizer),
            clone(self.rng, reuse and reuse.rng),
            json.loads(json.dumps(self.trainer)),
            self.critic.copied(reuse and reuse.critic) if self.critic is not None else None,
            clone(self.old_actor, reuse and reuse.old_actor),
        )


# ---------------------------------------------------------------- low-level durable writes


def write_tracker(save_dir: str | Path, value: int | str) -> None:
    """Atomically point the tracker at `value` (temp file, fsync, rename, fsync directory)."""
    save_dir = Path(save_dir)
    temp = save_dir / f".{TRACKER}.tmp-{os.getpid()}"
    try:
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(f"{value}\n")
            handle.flush()
            os.fsync(handle.fileno())
        fault_point("tracker_before_replace", save_dir)
        os.replace(temp, save_dir / TRACKER)
    finally:
        temp.unlink(missing_ok=True)  # a failed write leaves no temp file behind
    fsync_path(save_dir)


def _sync_and_hash(files: list[Path]) -> dict[Path, str]:
    """fsync every file and take its sha256, overlapped: the flush waits on the disk while the
    hash runs on a core (hashlib releases the GIL), so a save costs about the slower of the
    two instead of their sum. Raises the first OSError."""
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="mileage-sync") as pool:
        syncs = [pool.submit(fsync_path, path) for path in files]
        digests = {path: pool.submit(file_sha256, path) for path in files}
        for done in syncs:
            done.result()
        return {path: done.result() for path, done in digests.items()}


# ---------------------------------------------------------------- save and commit


def _write_contents(directory: Path, state: CheckpointState, tensors_written: bool) -> None:
    if not tensors_written:
        save_tensors(state.model, directory / MODEL_DIR)
        fault_point("save_after_model", directory)
        if state.optimizer is not None:
            save_tensors(state.optimizer, directory / OPTIMIZER_DIR)
            fault_point("save_after_optimizer", directory)
    if state.critic is not None:
        _write_critic(directory / CRITIC_DIR, state.critic, tensors_written)
    if state.rng:
        save_safetensors(state.rng, directory / RNG_FILE)
    if state.old_actor:
        save_safetensors(state.old_actor, directory / OLD_ACTOR_FILE)
    if state.trainer:
        write_json_durably(directory / TRAINER_STATE, state.trainer)
    write_json_durably(directory / META, state.meta)
    fault_point("save_after_state", directory)
    required = [f"{MODEL_DIR}/.metadata", META]
    if state.optimizer is not None:
        required.append(f"{OPTIMIZER_DIR}/.metadata")
    if state.critic is not None:
        required += [f"{CRITIC_DIR}/{MODEL_DIR}/.metadata", f"{CRITIC_DIR}/{META}"]
    for name in required:  # a directory deleted under the save must not commit as "complete"
        if not (directory / name).is_file():
            raise FileNotFoundError(errno.ENOENT, "written file vanished", str(directory / name))
    digests = _sync_and_hash(sorted(p for p in directory.rglob("*") if p.is_file()))
    fault_point("save_before_manifest", directory)
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": digest}
        for path, digest in digests.items()
    }
    write_json_durably(directory / MANIFEST, {"files": files})
    fsync_path(directory)


def _write_critic(directory: Path, critic: CheckpointState, tensors_written: bool) -> None:
    """critic/: model, optimizer, meta. `tensors_written`: every rank of a sharded run has
    already written the critic's shards there (`mileage.distributed.checkpoint`)."""
    if not tensors_written:
        directory.mkdir()
        save_tensors(critic.model, directory / MODEL_DIR)
        fault_point("save_after_critic_model", directory)
        save_tensors(critic.optimizer, directory / OPTIMIZER_DIR)
    write_json_durably(directory / META, critic.meta)
    fsync_path(directory)
    fault_point("save_after_critic", directory)


def staging_path(save_dir: str | Path, name: int | str) -> Path:
    target = checkpoint_path(save_dir, name)
    return Path(save_dir) / f"{STAGING_PREFIX}{target.name}-{os.getpid()}-{time.monotonic_ns()}"


def commit_checkpoint(
    save_dir: str | Path, name: int | str, state: CheckpointState, staging: Path | None = None
) -> Path:
    """Write `state` as iter_{name:07d} (or release/) under `save_dir` and move the tracker to it.

    `staging`: an existing staging directory into which all ranks of a sharded run have already
    written the model and optimizer tensors (`mileage.distributed.checkpoint`); the rest of the
    commit is the same.
    """
    save_dir = Path(save_dir)
    target = checkpoint_path(save_dir, name)
    tensors_written = staging is not None
    staging = staging or staging_path(save_dir, name)
    superseded = None
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        staging.mkdir(exist_ok=tensors_written)
        _write_contents(staging, state, tensors_written)
        fault_point("commit_before_rename", staging)
        if target.exists():
            # a complete checkpoint the tracker does not name (e.g. a kill between rename and
            # tracker); it is superseded by this one
            superseded = save_dir / f"{STAGING_PREFIX}old-{target.name}-{time.monotonic_ns()}"
            os.rename(target, superseded)
        os.rename(staging, target)
        fault_point("commit_after_rename", save_dir)
        fsync_path(save_dir)
        fault_point("commit_before_tracker", save_dir)
        write_tracker(save_dir, name)
        fault_point("commit_after_tracker", save_dir)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if superseded is not None:  # never tracked, and this save replaced it or failed
            shutil.rmtree(superseded, ignore_errors=True)
        where = exc.filename or save_dir
        if read_tracker(save_dir).raw.strip() == str(name):
            # the failure came after the tracker moved (syncing SAVE): the new checkpoint is it
            raise CheckpointWriteError(
                f"saving checkpoint {target.name}: the tracker names it, but syncing {where} "
                f"failed ({exc.strerror or exc}); it may not survive a power loss"
            ) from None
        raise CheckpointWriteError(
            f"saving checkpoint {target.name} failed: {exc.strerror or exc} ({where}); "
            f"the previous checkpoint and the tracker are untouched"
        ) from None
    remove_leftovers(save_dir)
    return target


def remove_leftovers(save_dir: str | Path) -> list[str]:
    """Delete staging directories of interrupted saves; returns their names."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    removed = []
    for entry in sorted(os.listdir(save_dir)):
        if entry.startswith(STAGING_PREFIX) or entry.startswith(f".{TRACKER}.tmp-"):
            path = save_dir / entry
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def prune_checkpoints(save_dir: str | Path, keep_last: int | None) -> list[str]:
    """Keep the newest `keep_last` complete checkpoints and the tracker's; delete older ones."""
    if not keep_last:
        return []
    state = scan_dir(save_dir)
    tracked = read_tracker(save_dir).iteration
    complete = state.complete_ids
    keep = set(complete[-keep_last:]) | ({tracked} if tracked is not None else set())
    removed = []
    for rollout_id in complete:
        if rollout_id not in keep and (tracked is None or rollout_id < tracked):
            name = iter_dir_name(rollout_id)
            doomed = Path(save_dir) / f"{STAGING_PREFIX}pruned-{name}-{time.monotonic_ns()}"
            os.rename(Path(save_dir) / name, doomed)
            shutil.rmtree(doomed)
            removed.append(name)
    return removed


# ---------------------------------------------------------------- load and verify


def read_json(checkpoint: str | Path, name: str) -> dict:
    return json.loads((Path(checkpoint) / name).read_text())


def verify_checkpoint(checkpoint: str | Path) -> list[str]:
    """Problems found by re-hashing every file against the manifest ([] = intact); each names
    the file and, in parentheses, the part of the run it holds (`part_of`)."""
    checkpoint = Path(checkpoint)
    info = inspect_checkpoint(checkpoint)
    if not info.complete:
        return [info.problem]
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    paths = [checkpoint / name for name in manifest["files"]]
    prefetch(paths)
    # hashlib releases the GIL, so files hash in parallel on all cores
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        digests = list(pool.map(file_sha256, paths))
    lora = "lora" in info.meta
    return [
        f"{path}: checksum mismatch ({part_of(name, lora)})"
        for path, digest, (name, entry) in zip(
            paths, digests, manifest["files"].items(), strict=True
        )
        if digest != entry["sha256"]
    ]


# The first component of a manifest entry -> the part of the run it restores, so a refusal says
# what is damaged (the rollout buffer of dynamic sampling and train-async lives in the trainer
# state).
PARTS = {
    MODEL_DIR: "model weights",
    OPTIMIZER_DIR: "optimizer state",
    CRITIC_DIR: "PPO critic",
    RNG_FILE: "RNG state",
    OLD_ACTOR_FILE: "kept old-actor weights (--keep-old-actor)",
    TRAINER_STATE: "trainer state (counters, data position, rollout buffer)",
    META: "checkpoint metadata",
}


def part_of(name: str, lora: bool = False) -> str:
    """The part of a run that the checkpoint file `name` (relative, as in the manifest) holds."""
    head = name.split("/", 1)[0]
    if head == MODEL_DIR and lora:
        return "LoRA adapter"
    return PARTS.get(head, name)


def require_intact(checkpoint: str | Path, flag: str = "--ckpt-step") -> None:
    """The one integrity check every restore goes through, before any part of `checkpoint` is
    loaded: every file its manifest lists (model or adapter, optimizer, critic, RNG, kept old
    actors, trainer state) is re-hashed, and the first damaged one refuses the start in one
    line naming its part. A loader never decides on its own whether to check: damage found
    only when a loader unpickles it surfaced as a torch traceback, or not at all."""
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise UserError(
            f"checkpoint {checkpoint} is corrupt: {problems[0]}; choose another with {flag}"
        )


__all__ = [
    "RELEASE",
    "CheckpointState",
    "commit_checkpoint",
    "require_intact",
    "verify_checkpoint",
]
