"""Which process of how many this is, and the small collectives every layer may use.

Without torchrun (or at a world size of 1) every helper answers for a single process, so the
single-process path needs no process group. The group itself is joined in
`mileage.distributed.env.session`; these helpers only read it. They live at the bottom of the
layers because checkpoints record the world size and the trainer splits its batches by rank,
and neither may import the distributed layer above them.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


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


def local_world_size() -> int:
    """Ranks on this machine (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main() -> bool:
    """Rank 0: the process that prints, logs metrics, holds the lock and commits checkpoints."""
    return rank() == 0


def is_distributed() -> bool:
    """True inside a process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
