"""The `mileage` process keeps freed memory for reuse instead of faulting in fresh pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mileage import allocator
from mileage.cli import main as cli_main

# allocate, touch and free the same 64 MiB 30 times; minor page faults counted over the last 10
# (64-byte-aligned blocks take a few cycles to settle into reusable holes)
_CYCLES = """
import json, resource, sys, torch
from mileage.allocator import keep_freed_memory

def faults():
    for cycle in range(30):
        if cycle == 20:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 * 2**20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
kept = keep_freed_memory()
print(json.dumps({"default": default, "kept": kept, "after": faults()}))
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
    assert got["default"] > 8 * pages  # glibc unmaps each free: every cycle faults again
    assert got["after"] < pages // 2  # reused


@pytest.mark.parametrize("var", ["MALLOC_MMAP_MAX_", "GLIBC_TUNABLES", "LD_PRELOAD"])
def test_a_users_own_malloc_tuning_is_left_alone(monkeypatch, var):
    monkeypatch.setenv(var, "1")
    assert allocator.keep_freed_memory() is False


def test_the_mileage_process_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("tuned") or True)
    monkeypatch.setattr(cli_main, "main", lambda argv=None: calls.append("main") or 0)
    assert cli_main.run() == 0
    assert calls == ["tuned", "main"]
    # `mileage` (the console script) and `python -m mileage` both start there
    repo = Path(__file__).resolve().parents[1]
    assert 'mileage = "mileage.cli.main:run"' in (repo / "pyproject.toml").read_text()
    assert "sys.exit(run())" in (repo / "mileage" / "__main__.py").read_text()
