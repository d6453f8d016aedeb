"""The `mileage` process keeps freed memory for reuse instead of faulting in fresh pages."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mileage import allocator
from mileage.cli import main as cli_main

# Allocate, touch and free the same 64 MiB 30 times and count the minor page faults of the
# last 10 cycles: with glibc's malloc directly (the block ends at the heap's top, where only the
# trim threshold keeps it) and as torch tensors (64-byte aligned, which take a few cycles to
# settle into reusable holes).
_CYCLES = """
import ctypes, json, resource, sys, torch
from mileage.allocator import keep_freed_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = 64 * 2**20

def with_malloc():
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)

def with_torch():
    torch.empty(SIZE // 4).fill_(1.0)

def faults(cycle):
    for n in range(30):
        if n == 20:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cycle()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults(with_malloc), faults(with_torch)]
kept = keep_freed_memory()
print(json.dumps({"default": default, "kept": kept, "after": [faults(with_malloc), faults(with_torch)]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_instead_of_faulting_in_again():
    env = {k: v for k, v in os.environ.items() if k not in allocator._USER_TUNING}
    out = subprocess.run(
        [sys.executable, "-c", _CYCLES], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept"] is True
    pages = 64 * 2**20 // 4096
    for default, after in zip(got["default"], got["after"], strict=True):
        assert default > 8 * pages  # glibc unmaps (or trims) each free: every cycle faults again
        assert after < pages // 2  # reused


@pytest.mark.parametrize("var", ["MALLOC_MMAP_MAX_", "GLIBC_TUNABLES", "LD_PRELOAD"])
def test_a_users_own_malloc_tuning_is_left_alone(monkeypatch, var):
    monkeypatch.setenv(var, "1")
    assert allocator.keep_freed_memory() is False


def test_the_mileage_process_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("tuned") or True)

    def main(argv=None, after_parse=None):
        calls.append("main")
        after_parse()  # turns the collector back on (tests/test_cli_startup.py)
        return 0

    monkeypatch.setattr(cli_main, "main", main)
    try:
        assert cli_main.run() == 0
    finally:  # what run() froze stays frozen, as conftest freezes the worker's imports
        gc.enable()
    assert calls == ["tuned", "main"]
    # `mileage` (the console script) and `python -m mileage` both start there
    repo = Path(__file__).resolve().parents[1]
    assert 'mileage = "mileage.cli.main:run"' in (repo / "pyproject.toml").read_text()
    assert "sys.exit(run())" in (repo / "mileage" / "__main__.py").read_text()
