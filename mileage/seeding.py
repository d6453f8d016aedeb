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


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json-able) views of the global RNG states."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def restore_rng_state(tensors: dict[str, torch.Tensor], plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
