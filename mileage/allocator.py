"""Keep freed memory in the process instead of handing it back to the kernel (glibc malloc).

glibc serves every block over its mmap threshold (128 KiB, rising to at most 32 MiB) with a
fresh `mmap` and unmaps it on free, and trims the heap's free top. A run allocates and frees the
same activations, gradients, logits and KV caches every step, so each came back as new pages
that faulted in 4 KiB at a time: 532,000 page faults in one SmolLM2 8x8x32 bf16 train phase
(135,000 with this), and 31 million in the README's demo command, which took 1 min 33 s against
33 s with this (docs/benchmarks.md §1, §7). With mmap and the trim off, freed blocks stay in
the heap and the next step reuses them. The cost is peak RSS: memory one phase frees stays in
the process for the next (+22 % on the demo, +1-2 % on SmolLM2 in bf16, +12 % in fp32, where
glibc's way took 1.2x the time; docs/benchmarks.md §1), flat over a run.
`MALLOC_MMAP_THRESHOLD_=131072` in the environment gives glibc's own behaviour back, trading
that time for that memory. PyTorch's CPU tuning guide reaches the same end with jemalloc or
tcmalloc preloaded; this needs no library.

Only the `mileage` process itself does this (`cli.main.run`), not code importing mileage. A
user who tunes malloc through the environment (`MALLOC_*`, `GLIBC_TUNABLES`, a preloaded
allocator) keeps their own.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters, <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

_USER_TUNING = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")  # fmt: skip


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and its heap trim in this process. Returns whether
    it did: not on a C library without `mallopt` (macOS, musl), nor when the environment already
    tunes the allocator (or preloads another one)."""
    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in _USER_TUNING):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # -1 turns trimming off altogether (mallopt(3)); mallopt returns 1 on success
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
