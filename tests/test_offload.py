"""--fsdp-cpu-offload (FSDP2's CPUOffloadPolicy). The policy is a GPU feature and the command
line refuses it without one; its mechanism runs on the CPU too, so two gloo ranks check it here
(`offload_worker.py`): the shards live on the host, training with and without offload is the
same bit for bit, and a checkpoint written either way restores into the other kind to the same
tensors and trains on to the same values. Memory and CUDA use are `scripts/gpu_check.sh`'s."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from conftest import REPO, torchrun_env
from test_memory import PASS, SMOLLM2, WORK

from mileage.training.memory import estimate, model_size

WORKER = Path(__file__).with_name("offload_worker.py")


def test_checkpoints_move_between_offloaded_and_resident_shards_bit_for_bit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(WORKER), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, **torchrun_env()},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("OK ")] == [
        "OK 2 steps with and without offload",
        "OK offload=False checkpoint restored",
        "OK offload=False resumed, 2 steps on",
        "OK offload=True checkpoint restored",
        "OK offload=True resumed, 2 steps on",
    ]


def test_offload_without_a_gpu_is_one_line_that_says_what_would_work(cli, tmp_path):
    done = cli("train", "--fsdp-cpu-offload", "--device", "cpu", "--save", tmp_path / "s")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0] and "drop the flag" in lines[0], lines
    assert not (tmp_path / "s").exists()


def test_the_memory_plan_counts_offloaded_state_on_the_host():
    """Per GPU with offload: one gathered layer and its gradient, no shards, no optimizer state;
    activations and logits unchanged."""
    size = model_size(SMOLLM2)
    work = replace(WORK, world_size=2, cuda=True, reference=True)
    resident = estimate(size, work, *PASS).parts
    offloaded = estimate(size, replace(work, offload=True), *PASS).parts
    layer = size.layer_params * 4
    assert offloaded["weights"] == offloaded["gradients"] == layer
    assert offloaded["optimizer"] == offloaded["reference"] == 0
    assert resident["weights"] == size.params * 4 // 2 + layer
    for part in ("activations", "logits", "engine"):
        assert offloaded[part] == resident[part]


def test_only_an_offloaded_gpu_run_adds_gloo_for_host_tensors():
    import torch

    from mileage.distributed import env

    gpu = torch.device("cuda", 0)
    assert env.backend_for(gpu, host_collectives=True) == "cuda:nccl,cpu:gloo"
    assert env.backend_for(gpu) == "nccl"
    assert env.backend_for(torch.device("cpu"), host_collectives=True) == "gloo"
