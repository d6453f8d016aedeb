"""The process group: set up from torchrun's environment, and small collectives on it.

`torchrun --nproc-per-node N -m mileage train ...` sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; `session()` joins the group (gloo on CPU, NCCL when the device is a GPU) and
leaves it at exit. `--device` (`request_device`) chooses the device: CUDA whenever it is visible
(`auto`, the default), at any world size, or the CPU. Without torchrun, or with a world size of 1, nothing is initialised and every
helper here answers for a single process, so the single-process path stays as it was.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from mileage.distributed.memory import keep_mmap_threshold
from mileage.errors import UserError
from mileage.parent_death import die_with_parent

# rank, world size and the small collectives live at the bottom layer (mileage.ranks); the
# distributed layer and the drivers above it keep reaching them as env.*
from mileage.ranks import (  # noqa: F401
    all_gather_object,
    any_rank,
    barrier,
    broadcast_object,
    is_distributed,
    is_main,
    local_rank,
    micro_batches,
    rank,
    share,
    sum_over_ranks,
    world_size,
)

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# a collective that waits longer than this on a dead peer fails instead of hanging forever
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


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


def backend_for(dev: torch.device, host_collectives: bool = False) -> str:
    """NCCL on a GPU, gloo on the CPU; with `host_collectives` (--fsdp-cpu-offload, whose
    gradient norm reduces over host shards, as torchtitan sets it up) gloo beside NCCL for
    the CPU tensors of a GPU run."""
    if dev.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


@contextmanager
def session(host_collectives: bool = False) -> Iterator[None]:
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
    dist.init_process_group(backend_for(dev, host_collectives), timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    except BaseException:
        # a peer may be dead or stuck: no collective on the way out, torchrun stops the rest
        dist.destroy_process_group()
        raise
    if not dist.is_initialized():
        return  # vLLM colocated under torchrun tears the group down as it shuts down
    # A finished rank waits for its peers before tearing its connections down: a gloo rank
    # whose peer closed while its own last collective was still draining aborted at exit
    # ("terminate called without an active exception"; seen once in a 2-rank probe).
    dist.barrier()
    dist.destroy_process_group()
