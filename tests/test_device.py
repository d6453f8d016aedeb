"""--device: CUDA whenever it is visible (at any world size), the CPU on request, and a one-line
refusal of `--device cuda` without a GPU; scripts/gpu_devices.py, which gpu_check.sh runs to
prove a GPU run trained on the GPU, is exercised here on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, builtin_train_args

from mileage.distributed import env
from mileage.distributed.parallelize import ParallelConfig
from mileage.errors import UserError


@pytest.fixture
def cuda_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture(autouse=True)
def reset_choice():
    yield
    env._requested = "auto"


@pytest.mark.parametrize("world", ["1", "2"])
def test_auto_takes_the_gpu_at_any_world_size(cuda_visible, monkeypatch, world):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_RANK", str(int(world) - 1))
    env.request_device("auto")
    assert env.device() == torch.device("cuda", int(world) - 1)
    assert env.backend_for(env.device()) == "nccl"


def test_cpu_is_kept_even_with_a_gpu(cuda_visible, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    env.request_device("cpu")
    assert env.device() == torch.device("cpu")
    assert env.backend_for(env.device()) == "gloo"


def test_cuda_is_taken_when_asked_and_visible(cuda_visible):
    env.request_device("cuda")
    assert env.device() == torch.device("cuda", 0)


def test_auto_without_cuda_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env.request_device("auto")
    assert env.device() == torch.device("cpu")


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda: .* sees no CUDA device; use --device cpu"):
        env.request_device("cuda")
    assert env._requested == "auto"  # a refused choice changes nothing


def test_bf16_needs_the_gpu_device(cuda_visible):
    ParallelConfig(device="auto", fsdp_mixed_precision="bf16").validate(2, 16, 4)
    with pytest.raises(UserError, match="needs GPUs under torchrun; this run is on CPU"):
        ParallelConfig(device="cpu", fsdp_mixed_precision="bf16").validate(2, 16, 4)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cli_device_cuda_without_gpu_is_one_line_exit_2(mileage_home):
    result = run_cli("-m", "mileage", "train", "--device", "cuda", "--num-rollout", "1")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--device cuda" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch of the device check")
def test_device_check_passes_on_cpu_and_fails_when_cuda_is_expected(builtin_model, tmp_path):
    flags = builtin_train_args("--num-rollout", "1", "--use-kl-loss", "--kl-loss-coef", "0.01")
    ok = run_cli("scripts/gpu_devices.py", "--expect", "cpu", "--", *flags)
    assert ok.returncode == 0, ok.stderr
    assert "parameters" in ok.stdout and "reference parameters" in ok.stdout
    assert "all on cpu" in ok.stdout
    # the same run checked for CUDA: it trained on the CPU, so the check must fail
    bad = run_cli("scripts/gpu_devices.py", "--expect", "cuda", "--", *flags)
    assert bad.returncode == 1
    for kind in ("parameters", "batch", "optimizer state", "reference parameters"):
        assert f"{kind} on ['cpu'], expected cuda" in bad.stderr
