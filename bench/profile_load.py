"""Where a checkpoint load's time goes: cProfile of loading a checkpoint's optimizer state (DCP)
from a cold page cache.

    mileage train --hf-checkpoint "$(mileage smollm2)" --num-rollout 1 --rollout-batch-size 1 \
        --n-samples-per-prompt 2 --rollout-max-response-len 4 --eval-interval 0 --save /tmp/smolck
    python bench/profile_load.py /tmp/smolck/iter_0000000

The page cache is dropped for every file of the checkpoint first (fsync + POSIX_FADV_DONTNEED),
and DCP is imported before profiling, as it is in a training process.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint  # noqa: F401  (imported before timing, as in a run)
from _common import DEFAULT_THREADS

from mileage.checkpoint.tensors import OPTIMIZER_DIR, load_tensors


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    checkpoint = Path(argv[0])
    torch.set_num_threads(DEFAULT_THREADS)
    for path in checkpoint.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    started = time.perf_counter()
    profiler = cProfile.Profile()
    profiler.enable()
    tensors = load_tensors(checkpoint / OPTIMIZER_DIR)
    profiler.disable()
    gigabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    print(f"{gigabytes:.2f} GB in {len(tensors)} tensors: {time.perf_counter() - started:.2f} s")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
