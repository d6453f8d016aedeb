"""Writing, committing, loading and verifying checkpoints.

Commit order (a kill at any instant leaves the tracker absent or naming a complete checkpoint).
Each gap has a named fault point (`mileage.faults`), so the tests can kill or fail a save there:
  1. write everything under SAVE/.staging-<name>-<pid>-<n>/: model [save_after_model],
     optimizer [save_after_optimizer], with PPO the critic's model [save_after_critic_model],
     optimizer and meta [save_after_critic] (inside the same staging directory, so the one
     rename and tracker below commit actor and critic together), RNG, trainer state and meta
     [save_after_state]; fsync
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
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

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
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.seeding import overwritten_allocations

MODEL_DIR, OPTIMIZER_DIR, RNG_FILE, TRAINER_STATE = (
    "model",
    "optimizer",
    "rng.safetensors",
    "trainer_state.json",
)


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
        )


# ---------------------------------------------------------------- low-level durable writes


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, durably; its I/O failures (a Rust error type) become OSError, so
    a failing save is reported like any other write error."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as exc:
        raise OSError(errno.EIO, f"writing {path.name} failed: {exc}", str(path)) from None
    fsync_path(path)


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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    # single-process DCP warns that no process group exists; that is the intended mode here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Write `tensors` as a DCP directory; its files are fsynced later, by `_sync_and_hash`."""
    import torch.distributed.checkpoint as dcp  # ~0.8 s of imports; runs without --save skip it
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_dcp():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=False))
    except CheckpointException as exc:
        # DCP wraps the writer's failure (disk full, I/O error) per rank; report it as the
        # OSError it is, so a failing save stops with one line like any other write error
        # (each failure is an (exception, traceback) pair)
        errors = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        cause = next((e for e in errors if isinstance(e, OSError)), None)
        if cause is not None:
            raise cause from None
        raise OSError(
            errno.EIO, f"writing {directory.name} failed: {exc}", str(directory)
        ) from None
    fsync_path(directory)


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


def tensor_metadata(directory: str | Path) -> dict:
    """Name -> DCP metadata (global size, dtype) of every entry of a DCP directory."""
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata


def load_tensors(
    directory: str | Path, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Load a DCP tensor directory; into `into`'s tensors in place if given, else fresh tensors.

    `into` may hold DTensors (FSDP shards): each process then reads just its own shards, from a
    checkpoint saved at any world size. Loads never communicate, so one rank alone may load.
    """
    import torch.distributed.checkpoint as dcp

    prefetch_checkpoint(directory)
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    if any(not hasattr(m, "size") for m in metadata.values()):
        raise UserError(
            f"{directory} holds non-tensor entries; mileage never writes those, refusing to unpickle"
        )
    missing = sorted(set(into or {}) - set(metadata))
    if missing:
        raise UserError(
            f"{directory} lacks {len(missing)} tensors the model needs, e.g. {missing[0]}"
        )
    with overwritten_allocations(), _quiet_dcp():
        if into is None:
            into = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()}
        dcp.load(into, storage_reader=reader, no_dist=True)
    return into


# ---------------------------------------------------------------- save and commit


def _write_contents(directory: Path, state: CheckpointState, tensors_written: bool) -> None:
    if not tensors_written:
        save_tensors(state.model, directory / MODEL_DIR)
        fault_point("save_after_model", directory)
        if state.optimizer is not None:
            save_tensors(state.optimizer, directory / OPTIMIZER_DIR)
            fault_point("save_after_optimizer", directory)
    if state.critic is not None:
        _write_critic(directory / CRITIC_DIR, state.critic)
    if state.rng:
        save_safetensors(state.rng, directory / RNG_FILE)
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


def _write_critic(directory: Path, critic: CheckpointState) -> None:
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


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each shared tensor once (tied embeddings would otherwise be
    written, hashed and read twice: 0.11 GB of SmolLM2's 0.65 GB)."""
    seen: set[tuple[int, int]] = set()
    tensors = {}
    aliases = tied_aliases(model)
    for name, value in model.state_dict().items():
        if name in aliases:
            continue
        if hasattr(value, "to_local"):  # a DTensor shard: tied names were dropped above
            tensors[name] = value
            continue
        key = (value.untyped_storage().data_ptr(), value.storage_offset())
        if key in seen and value.numel():
            continue
        seen.add(key)
        tensors[name] = value
    return tensors


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names under which an already-listed parameter appears again (tied LM head)."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def load_model_weights(checkpoint: str | Path, model: torch.nn.Module) -> None:
    """Load a native checkpoint's weights into `model` in place (tied tensors share storage, so
    loading one name fills both)."""
    load_tensors(Path(checkpoint) / MODEL_DIR, into=model_tensors(model))


def optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Optimizer state as flat `{param_name}.{key}` tensors (resharding-friendly, no pickles)."""
    names = {id(p): n for n, p in model.named_parameters()}
    flat = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                flat[f"{names[id(param)]}.{key}"] = (
                    value if torch.is_tensor(value) else torch.tensor(value)
                )
    return flat


def load_optimizer_tensors(
    checkpoint: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load into tensors laid out like their parameters (sharded like them under FSDP)."""
    directory = Path(checkpoint) / OPTIMIZER_DIR
    params = dict(model.named_parameters())
    targets = {}
    with overwritten_allocations():
        for name, meta in tensor_metadata(directory).items():
            param_name, _, key = name.rpartition(".")
            if param_name not in params:
                raise UserError(f"{checkpoint}: optimizer state for unknown parameter {param_name}")
            param = params[param_name]
            dtype = getattr(getattr(meta, "properties", None), "dtype", None)
            if getattr(meta, "size", None) == param.shape and dtype is not None:
                targets[name] = torch.empty_like(param, dtype=dtype, requires_grad=False)
            elif dtype is not None:
                targets[name] = torch.empty(meta.size, dtype=dtype)
    tensors = load_tensors(directory, into=targets)
    for name, value in tensors.items():
        param_name, _, key = name.rpartition(".")
        optimizer.state[params[param_name]][key] = value


def load_rng_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / RNG_FILE))


def read_json(checkpoint: str | Path, name: str) -> dict:
    return json.loads((Path(checkpoint) / name).read_text())


def prefetch(paths: Iterable[Path]) -> None:
    """Ask the kernel to start reading these files into the page cache, without waiting.

    A load alternates reading with CPU work (hashing, copying into tensors); with the reads
    queued up front the disk streams at full speed while the CPU works.
    """
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # the load itself reports missing files
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advice only
        finally:
            os.close(fd)


def prefetch_checkpoint(checkpoint: str | Path) -> None:
    prefetch(sorted(p for p in Path(checkpoint).rglob("*") if p.is_file()))


def verify_checkpoint(checkpoint: str | Path) -> list[str]:
    """Problems found by re-hashing every file against the manifest ([] = intact)."""
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
    return [
        f"{path}: checksum mismatch"
        for path, digest, entry in zip(paths, digests, manifest["files"].values(), strict=True)
        if digest != entry["sha256"]
    ]


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in sorted-name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


__all__ = ["RELEASE", "CheckpointState", "commit_checkpoint", "load_tensors", "verify_checkpoint"]
