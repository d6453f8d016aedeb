"""Keeping freed memory out of a rank's resident set (glibc's allocator; a no-op elsewhere).

glibc serves a request above its mmap threshold (128 KiB at start) with a mapping of its own,
returned to the OS when freed, and smaller ones from its heaps, which keep freed memory for
reuse. Every time a mapped block is freed, glibc raises the threshold to that block's size (up
to 32 MiB), so after the first few freed tensors almost every tensor of a 135M-parameter model
(a layer's weights are 1-4 MiB) comes from the heaps. A torchrun rank allocates and frees such
tensors all the time (each layer's gathered parameters in forward and backward, the gradients
before their reduce-scatter, the full values while rank 0 loads), and the freed blocks stay in
its resident set, fragmented, while later tensors land elsewhere: on SmolLM2 at N=2 this was
0.6-0.9 GiB of a rank's 2.6-2.9 GiB peak (docs/distributed.md).

`keep_mmap_threshold` fixes the threshold (at 1 MiB), which also turns the raising off, so
large tensors keep being mapped and unmapped. (`malloc_trim(0)` after loading
and sharding did not lower the peak measurably: the memory that matters is freed and
reallocated during training, not once at load.) `mallopt` is looked up at run time; where the C
library lacks it (macOS, musl) nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# above glibc's starting 128 KiB: every mapped block is zero-filled page by page when touched,
# and at 128 KiB a SmolLM2 forward and backward took 1.5x as long as with glibc's default on the
# shared VM (1 MiB: about as long), while most blocks that fragment (a layer's gathered
# weights and gradients, the MLP's activations) are above 1 MiB
MMAP_THRESHOLD = 1 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None


def keep_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation above `threshold` bytes with its own mapping from now on (and stop
    glibc from raising the threshold); True where the C library took it."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
