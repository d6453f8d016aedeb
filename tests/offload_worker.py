"""torchrun worker of tests/test_offload.py (two gloo ranks on the CPU) and of
scripts/gpu_check.sh (one or two ranks on GPUs).

The same tiny Llama sharded twice by `shard_from_rank0`, once with `--fsdp-cpu-offload`'s
CPUOffloadPolicy and once without, trained with mileage's optimizer and gradient clipping; then
each one's checkpoint tensors (model and optimizer, through mileage's DCP save and load) loaded
into a fresh copy of the other kind, and both trained on. Prints one line per check; a
difference raises. On a GPU the optimizer of the offloaded kind steps on the CPU and the other
on the GPU, so training is compared within 1e-5 there (a restored checkpoint still exactly),
and the GPU memory each kind holds is printed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mileage.checkpoint.tensors import (
    OPTIMIZER_DIR,
    load_optimizer_tensors,
    load_tensors,
    optimizer_tensors,
    save_tensors,
)
from mileage.distributed import env
from mileage.distributed.parallelize import (
    ParallelConfig,
    fsdp_modules,
    full_value,
    shard_from_rank0,
)
from mileage.models.tensors import model_tensors
from mileage.training.optimizer import OptimConfig, build_optimizer


def build(offload: bool):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = shard_from_rank0(LlamaForCausalLM(config), ParallelConfig(fsdp_cpu_offload=offload))
    return model, build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))


def offloaded(model) -> set[bool]:
    """Whether each FSDP2 unit of `model` has the CPU offload policy. Private API, but the only
    witness on a CPU host, where shards of both kinds live in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp_modules(model)]
    return {isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g is not None}


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        rows = torch.Generator().manual_seed(1000 * step + env.rank())
        ids = torch.randint(0, 64, (2, 12), generator=rows).to(env.device())
        model(input_ids=ids, labels=ids).loss.backward()
        # a collective over the (host) shards' norms, as the actor clips
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def whole(model, optimizer) -> dict[str, torch.Tensor]:
    tensors = {**model_tensors(model), **optimizer_tensors(model, optimizer)}
    return {k: full_value(v) for k, v in tensors.items()}


def same(a: dict, b: dict, what: str, trained: bool = True) -> None:
    """`a` equals `b` exactly; within 1e-5 when trained on a GPU with and without offload."""
    assert a.keys() == b.keys(), what
    if trained and env.device().type == "cuda":
        worst = max(float((a[k].cpu().double() - b[k].cpu().double()).abs().max()) for k in a)
        assert worst < 1e-5, f"{what}: max abs diff {worst:.3g}"
        what += f" (max abs diff {worst:.3g}: CPU and GPU optimizers)"
    else:
        differ = [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]
        assert not differ, f"{what}: {differ[:3]} differ"
    if env.is_main():
        print(f"OK {what}", flush=True)


def save(model, optimizer, directory: Path) -> None:
    save_tensors(model_tensors(model), directory / "model")
    save_tensors(optimizer_tensors(model, optimizer), directory / OPTIMIZER_DIR)


def restore(offload: bool, directory: Path):
    model, optimizer = build(offload)
    load_tensors(directory / "model", into=model_tensors(model))
    load_optimizer_tensors(directory, model, optimizer)
    return model, optimizer


def main(root: Path) -> None:
    runs = {}
    for offload in (False, True):
        runs[offload] = build(offload)
        if env.device().type == "cuda" and env.is_main():
            held = torch.cuda.memory_allocated() / 2**20
            kind = "the offloaded copy too" if offload else "the resident copy"
            print(f"GPU memory held with {kind}: {held:.3f} MiB", flush=True)
    assert offloaded(runs[True][0]) == {True} and offloaded(runs[False][0]) == {False}
    for model, optimizer in runs.values():
        train(model, optimizer, range(2))
    same(*(whole(*runs[o]) for o in (False, True)), "2 steps with and without offload")
    for offload, (model, optimizer) in runs.items():
        save(model, optimizer, root / f"offload_{offload}")
    for written in (False, True):  # each checkpoint restored into the other kind
        restored = restore(not written, root / f"offload_{written}")
        same(
            whole(*restored), whole(*runs[written]), f"offload={written} checkpoint restored", False
        )
        train(*restored, range(2, 4))
        train(*runs[written], range(2, 4))
        same(whole(*restored), whole(*runs[written]), f"offload={written} resumed, 2 steps on")


if __name__ == "__main__":
    import torch.distributed as dist

    # a process group at any world size (FSDP2 needs one even for one rank)
    if env.device().type == "cuda":
        torch.cuda.set_device(env.device())
    dist.init_process_group(env.backend_for(env.device(), host_collectives=True))
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
    dist.barrier()
    dist.destroy_process_group()
