"""Randomness that depends only on (seed, purpose, index), never on process history.

A resumed run must draw exactly what the uninterrupted run drew, so every random choice gets
its own generator seeded from `derive_seed(seed, purpose, index)` — for example
`("rollout", rollout_id)` for sampling and `("shuffle", epoch)` for data order. The global RNG
states are still captured in checkpoints (`capture_rng_state`) for user code that relies on them.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def derive_seed(seed: int, purpose: str, index: int = 0) -> int:
    """A 63-bit seed that is a pure function of its arguments."""
    digest = hashlib.sha256(f"{seed}/{purpose}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator_for(seed: int, purpose: str, index: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, purpose, index))


def configure_determinism(seed: int, num_threads: int) -> None:
    """Fix everything that makes CPU compute depend on more than its inputs.

    The thread count changes the order of floating-point reductions, so it is fixed explicitly
    and recorded in every checkpoint. On GPU, `torch.use_deterministic_algorithms` additionally
    needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (set here if absent).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode also fills every new tensor with NaN, a debugging aid that shows reads
    # of uninitialised memory; it does not make any kernel more deterministic. It is one more
    # pass over every activation, gradient and KV cache (the profile at 78fc734 charged aten::
    # fill_ with 24 % of the SmolLM2 train phase, mostly the page faults of the fresh memory it
    # touched first: mileage/allocator.py).
    torch.utils.deterministic.fill_uninitialized_memory = False
    random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def overwritten_allocations() -> Iterator[None]:
    """Allocate buffers that are overwritten in full right away (a load target, a snapshot).

    Deterministic mode fills every `torch.empty` with NaN so that reads of uninitialised memory
    show up; for these buffers that fill is one more pass over the whole training state (it was
    a third of the time to load an optimizer state).
    """
    previous = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = previous


# the CUDA generator of this process's current device (each torchrun rank has its own, and its
# own entry in the checkpoint: distributed/checkpoint.py prefixes other ranks' keys)
CUDA_KEY = "torch_cuda"
# checkpoints written before then hold every visible device's state as torch_cuda_<index>
_LEGACY_CUDA_PREFIX = "torch_cuda_"


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json-able) views of the global RNG states: the CPU's, Python's and, when CUDA is
    visible, the current device's only, so that a resume on a machine showing fewer (or other)
    GPUs restores what this process used."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors[CUDA_KEY] = torch.cuda.get_rng_state(torch.cuda.current_device())
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def _cuda_state(tensors: dict[str, torch.Tensor], device: int) -> torch.Tensor | None:
    """The saved state for CUDA device `device`: the current-device entry, or from an older
    checkpoint the entry of that index (by number: torch_cuda_10 comes after torch_cuda_2)."""
    if CUDA_KEY in tensors:
        return tensors[CUDA_KEY]
    legacy = {
        int(k[len(_LEGACY_CUDA_PREFIX) :]): v
        for k, v in tensors.items()
        if k.startswith(_LEGACY_CUDA_PREFIX) and k[len(_LEGACY_CUDA_PREFIX) :].isdigit()
    }
    return legacy.get(device)


def restore_rng_state(tensors: dict[str, torch.Tensor], plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        state = _cuda_state(tensors, device)
        if state is not None:  # a checkpoint from a CPU run has none: nothing to restore
            torch.cuda.set_rng_state(state, device)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
