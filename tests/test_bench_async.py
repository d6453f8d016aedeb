"""bench/async.py's engine-on-its-own-core topology: the wrapper that pins a launched vLLM, the
pinned `mileage serve`, and the refusal of `--engine vllm` without a vLLM."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))  # the scripts import `_common` as a sibling
    try:
        spec = importlib.util.spec_from_file_location(
            f"bench_{name}_under_test", BENCH / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


bench_async = _load("async")


def test_the_pinned_python_runs_the_given_python_on_that_core(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to tell a pinned process from an unpinned one")
    wrapper = bench_async.pinned_python(sys.executable, "1", tmp_path)
    probe = "import os, sys; print(sorted(os.sched_getaffinity(0)), sys.prefix, os.environ['VLLM_CPU_OMP_THREADS_BIND'])"
    done = subprocess.run([wrapper, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # the venv's python itself (a resolved symlink would lose the venv), on core 1 only
    assert done.stdout.split() == ["[1]", sys.prefix, "1"]


def test_engine_vllm_without_a_vllm_python_exits_2_before_measuring() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "async.py"), "--engine", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1].endswith(
        "--engine vllm needs --vllm-python (scripts/install_vllm.sh)"
    )


def test_a_pinned_server_runs_on_its_core(mileage_home) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to tell a pinned process from an unpinned one")
    from mileage.testing.servers import start_servers

    common = _load("_common")
    assert common.served_model(["--lr", "1", "--hf-checkpoint", "/m"]) == "/m"
    (server,) = start_servers(common.served_model([]), 1, cores="1")  # the built-in model
    try:
        # taskset execs the server: the pid started is the server's own
        assert os.sched_getaffinity(server.proc.pid) == {1}
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop()
    assert not server.alive()
