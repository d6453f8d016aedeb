"""Tensors in and out of checkpoints: DCP directories for model and optimizer (keyed by name,
so they reshard to another world size), safetensors for small flat files (RNG), and the
digests `ckpt ls` prints.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mileage.checkpoint.files import fsync_path, prefetch_checkpoint
from mileage.errors import UserError
from mileage.models.tensors import model_tensors
from mileage.seeding import overwritten_allocations

MODEL_DIR, OPTIMIZER_DIR, RNG_FILE = "model", "optimizer", "rng.safetensors"
# train-async --keep-old-actor: the older weight versions its rollout buffer was generated with
OLD_ACTOR_FILE = "old_actor.safetensors"


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, durably; its I/O failures (a Rust error type) become OSError, so
    a failing save is reported like any other write error."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as exc:
        raise OSError(errno.EIO, f"writing {path.name} failed: {exc}", str(path)) from None
    fsync_path(path)


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    # single-process DCP warns that no process group exists; that is the intended mode here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, process_group=None) -> None:
    """Write `tensors` as a DCP directory; its files are fsynced later, by `_sync_and_hash`.

    `process_group`: the group DCP's collectives run on under torchrun (default: the whole
    world's); a background save passes its own, so they never meet training's."""
    import torch.distributed.checkpoint as dcp  # ~0.8 s of imports; runs without --save skip it
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_dcp():
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(str(directory), sync_files=False),
                process_group=process_group,
            )
    except CheckpointException as exc:
        # DCP wraps the writer's failure (disk full, I/O error) per rank; report it as the
        # OSError it is, so a failing save stops with one line like any other write error
        # (each failure is an (exception, traceback) pair)
        errors = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        cause = next((e for e in errors if isinstance(e, OSError)), None)
        if cause is not None:
            raise cause from None
        # not an OSError: torch.save's zip writer reports a full disk as a RuntimeError
        # ("unexpected pos ..."), and DCP's own message carries every rank's traceback; keep
        # the first line of the first failure, and say how much room the file system has left
        first = errors[0] if errors else exc
        line = (str(first).strip().splitlines() or [""])[0]
        raise OSError(
            errno.EIO,
            f"writing {directory.name} failed: {type(first).__name__}: {line}{_room(directory)}",
            str(directory),
        ) from None
    fsync_path(directory)


def _room(directory: Path) -> str:
    """' (N MiB free on its file system)', or '' where that cannot be read."""
    for place in (directory, *directory.parents):
        try:
            return f" ({shutil.disk_usage(place).free / 2**20:.0f} MiB free on its file system)"
        except OSError:
            continue
    return ""


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
    # the fused AdamW keeps its step counts on the parameters' device, the per-tensor loop on
    # the CPU (what torch's own load_state_dict arranges)
    fused = any(group.get("fused") for group in optimizer.param_groups)
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
                device = param.device if fused else torch.device("cpu")
                targets[name] = torch.empty(meta.size, dtype=dtype, device=device)
    tensors = load_tensors(directory, into=targets)
    for name, value in tensors.items():
        param_name, _, key = name.rpartition(".")
        optimizer.state[params[param_name]][key] = value


def load_old_actor_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The kept old-actor weights of a checkpoint ({} when it holds none)."""
    path = Path(checkpoint) / OLD_ACTOR_FILE
    return load_file(str(path)) if path.is_file() else {}


def load_rng_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / RNG_FILE))


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in sorted-name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
