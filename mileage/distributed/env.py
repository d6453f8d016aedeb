"""The process group: set up from torchrun's environment, and small collectives on it.

`torchrun --nproc-per-node N -m mileage train ...` sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; `session()` joins the group (gloo on CPU, NCCL when the device is a GPU) and
leaves it at exit. `--device` (`request_device`) chooses the device: CUDA whenever it is visible
(`auto`, the default), at any world size, or the CPU. Without torchrun, or with a world size of 1, nothing is initialised and every
helper here answers for a single process, so the single-process path stays as it was.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mileage.distributed.memory import keep_mmap_threshold
from mileage.errors import UserError
from mileage.parent_death import die_with_parent

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# a collective that waits longer than this on a dead peer fails instead of hanging forever
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0: the process that prints, logs metrics, holds the lock and commits checkpoints."""
    return rank() == 0


def is_distributed() -> bool:
    """True inside a process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# what --device asked for; `request_device` sets it before the run is built
_requested = "auto"


def check_device_choice(choice: str) -> None:
    """Refuse `--device cuda` where torch sees no GPU (one line, before anything runs)."""
    if choice not in DEVICE_CHOICES:
        raise UserError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        build = (
            "a CPU-only build"
            if torch.version.cuda is None
            else f"built for CUDA {torch.version.cuda}"
        )
        raise UserError(
            f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device; "
            "use --device cpu, or --device auto to take a GPU only when one is visible"
        )


def resolve_device(choice: str, local: int) -> torch.device:
    """The device `choice` means for the process of local rank `local`."""
    if choice != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local)
    return torch.device("cpu")


def request_device(choice: str) -> None:
    """Make `device()` answer for `--device choice` from now on."""
    global _requested
    check_device_choice(choice)
    _requested = choice


def device() -> torch.device:
    """This rank's device: its GPU (cuda:LOCAL_RANK) whenever CUDA is visible and --device is not
    cpu, whatever the world size; else the CPU."""
    return resolve_device(_requested, local_rank())


def backend_for(dev: torch.device) -> str:
    return "nccl" if dev.type == "cuda" else "gloo"


@contextmanager
def session() -> Iterator[None]:
    """Join the process group torchrun describes (if it describes more than one process)."""
    if world_size() <= 1 or dist.is_initialized():
        yield
        return
    # torchrun starts each worker in a session of its own: without this, a SIGKILLed torchrun
    # leaves its workers running, holding the lock, until their next collective times out
    die_with_parent(signal.SIGKILL)
    # large tensors mapped and unmapped, not kept in glibc's heaps once freed (memory.py says why)
    keep_mmap_threshold()
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    except BaseException:
        # a peer may be dead or stuck: no collective on the way out, torchrun stops the rest
        dist.destroy_process_group()
        raise
    # A finished rank waits for its peers before tearing its connections down: a gloo rank
    # whose peer closed while its own last collective was still draining aborted at exit
    # ("terminate called without an active exception"; seen once in a 2-rank probe).
    dist.barrier()
    dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a one-element list in a single process)."""
    if not is_distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any (e.g. a signal that reached one rank)."""
    return any(all_gather_object(bool(flag)))


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Key-wise sums over ranks, added in rank order so every rank gets the same floats."""
    if not is_distributed():
        return values
    total: dict[str, float] = {}
    for part in all_gather_object(values):
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def share(count: int, parts: int | None = None, index: int | None = None) -> range:
    """This rank's contiguous share of `count` items; earlier ranks take one more if uneven."""
    parts = world_size() if parts is None else parts
    index = rank() if index is None else index
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def micro_batches(start: int, global_batch: int, micro_batch: int) -> list[tuple[int, int]]:
    """(start, end) of this rank's micro-batches of the global batch at `start`.

    Each rank takes a contiguous 1/N of the global batch and cuts it into micro-batches of at
    most `micro_batch`; in one process that is the whole global batch, as before.
    """
    mine = share(global_batch)
    size = min(micro_batch, len(mine))
    first = start + mine.start
    return [(m, m + size) for m in range(first, first + len(mine), size)]
