"""Sharding a model with FSDP2, in one place.

As torchtitan does it: `fully_shard` each decoder layer (its parameters are gathered just for its
own forward and backward, then freed), then the root module (embeddings, final norm, LM head;
tied embeddings stay one parameter there). Gradients are summed over ranks, not averaged: each
rank's loss is already divided by the token count of the whole global batch, so the sum is the
single-process gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mileage.config import option
from mileage.distributed import env
from mileage.errors import UserError


@dataclass
class ParallelConfig:
    device: str = option(
        "auto",
        "where the trainer runs: auto (a GPU, cuda:LOCAL_RANK, whenever CUDA is visible, at any "
        "world size; else the CPU), cpu, or cuda (refused when no GPU is visible)",
        choices=env.DEVICE_CHOICES,
    )
    fsdp_mixed_precision: str = option(
        "none",
        "under torchrun on GPUs: bf16 parameters in forward/backward, fp32 gradient reduction",
        choices=("none", "bf16"),
    )
    fsdp_cpu_offload: bool = option(
        False,
        "under torchrun on GPUs: keep FSDP2's parameter shards, gradients and optimizer state in "
        "host memory (CPUOffloadPolicy): each layer's shards are copied to the GPU for its "
        "forward and backward, and the optimizer steps on the CPU (miles' meaning)",
    )
    gradient_checkpointing: bool = option(
        False,
        "recompute each decoder layer's forward in the backward instead of keeping its "
        "activations (the actor's and the critic's, in one process or under FSDP2): a fraction "
        "of the activation memory for one more forward per step",
    )

    def validate(self, world_size: int, global_batch: int, micro_batch: int) -> None:
        if global_batch % world_size:
            raise UserError(
                f"the global batch ({global_batch} samples) must split evenly over the "
                f"{world_size} processes; change --global-batch-size or --nproc-per-node"
            )
        per_rank = global_batch // world_size
        if per_rank % min(micro_batch, per_rank):
            raise UserError(
                f"each process trains {per_rank} samples per step, which --micro-batch-size "
                f"{micro_batch} does not divide"
            )
        env.check_device_choice(self.device)
        on_gpu = env.resolve_device(self.device, 0).type == "cuda"
        if self.fsdp_cpu_offload and not on_gpu:
            raise UserError(
                "--fsdp-cpu-offload moves FSDP2's shards and optimizer state from GPU memory "
                "to host memory; this run has no GPU, so they are in host memory already: drop "
                "the flag"
            )
        if self.fsdp_cpu_offload and world_size <= 1:
            raise UserError(
                "--fsdp-cpu-offload offloads FSDP2's shards, and mileage shards with FSDP2 under "
                "torchrun with more than one process; one process keeps the whole model on its "
                "GPU (use --gradient-checkpointing or LoRA to fit it there)"
            )
        if self.fsdp_mixed_precision != "none" and (world_size <= 1 or not on_gpu):
            raise UserError(
                "--fsdp-mixed-precision bf16 needs GPUs under torchrun; this run is on CPU"
                if not on_gpu
                else "--fsdp-mixed-precision bf16 applies to FSDP, i.e. torchrun with more than one process"
            )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (`model.model.layers` for Llama-likes)."""
    # body.layers: the PPO critic's value model (`training.critic.ValueModel`) around a Llama-like
    paths = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")
    for path in (*paths, "body.layers", "body.h"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise UserError(
        f"cannot find the decoder layers of {type(model).__name__} to shard; "
        "supported: models with model.layers, transformer.h, gpt_neox.layers or model.decoder.layers"
    )


def is_meta(model: torch.nn.Module) -> bool:
    """True for a model built on the meta device (no storage: its values come from rank 0)."""
    return any(p.is_meta for p in model.parameters())


def shard_model(model: torch.nn.Module, cfg: ParallelConfig) -> torch.nn.Module:
    """Shard `model` in place over all ranks (FSDP2) and return it. A model on the meta device
    stays there (`load_from_rank0` gives it storage and values). With --fsdp-cpu-offload the
    shards and buffers stay on the host (`shard_from_rank0` moves the buffers once they are
    broadcast)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if cfg.fsdp_cpu_offload:  # the shards stay in (pinned) host memory: no copy to the GPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device().type == "cuda")
    elif not is_meta(model):
        model.to(env.device())
    if cfg.fsdp_mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for module in [*decoder_layers(model), model]:  # the root last: it takes what is left
        fully_shard(module, **kwargs)
        # a plain SUM reduction (also the only one gloo has): no division, no pre-multiply
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move `model`'s buffers (not managed by FSDP2: the rotary frequencies) to `device`; with
    --fsdp-cpu-offload the parameters stay on the host, but the forward runs on the GPU."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def shard_device(cfg: ParallelConfig) -> torch.device:
    """Where this rank's shards live: its device, or the host with --fsdp-cpu-offload."""
    return torch.device("cpu") if cfg.fsdp_cpu_offload else env.device()


def shard_from_rank0(model: torch.nn.Module, cfg: ParallelConfig) -> torch.nn.Module:
    """Shard `model`, whose values only rank 0 holds (the other ranks built it on the meta
    device), and give every rank its shards of them. No rank but 0 ever holds the full model:
    `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)` sends rank 0's
    tensors one at a time and each rank keeps its shard. Buffers (the rotary frequencies are not
    in the state dict) are not sharded; they are broadcast whole. Values are copied bit for bit.
    A collective: every rank calls it, in the same order for every model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not env.is_distributed():  # one rank (a GPU check; the command line shards at N > 1)
        shard_model(model, cfg)
        if cfg.fsdp_cpu_offload:
            buffers_to(model, env.device())
        return model
    # rank 0's full values, kept alive past fully_shard (which replaces the parameters)
    full = {k: v.detach() for k, v in model.state_dict().items()} if env.is_main() else {}
    shard_model(model, cfg)
    if is_meta(model) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=shard_device(cfg))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    del full
    with torch.no_grad():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    if cfg.fsdp_cpu_offload:
        buffers_to(model, env.device())
    return model


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective), or the tensor itself."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


@torch.no_grad()
def copy_full_weights(sharded: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Overwrite `plain`'s parameters and buffers with the full values of `sharded`'s.

    One all-gather per tensor, once per rollout: the generation engine then decodes with the
    plain copy and needs no communication per token.
    """
    targets = dict(plain.named_parameters(remove_duplicate=False))
    targets.update(dict(plain.named_buffers(remove_duplicate=False)))
    sources = list(sharded.named_parameters()) + list(sharded.named_buffers())
    for name, value in sources:
        targets[name].copy_(full_value(value.detach()))


@contextmanager
@torch.no_grad()
def swapped_weights(
    model: torch.nn.Module, values: dict[str, torch.Tensor]
) -> Iterator[torch.nn.Module]:
    """`model` computing with `values` (whole tensors, by parameter name) in place of those
    parameters; its own values are put back bit for bit on exit. A sharded parameter takes this
    rank's shard of its value (no collective: every rank holds the whole value). FSDP's gathered
    copies are freed on entry and exit (the root keeps its own gathered after a forward), so a
    forward inside all-gathers the swapped shards and one after it the model's own."""
    params = dict(model.named_parameters())
    missing = set(values) - set(params)
    if missing:
        raise RuntimeError(f"no parameter {sorted(missing)[0]} to swap weights into")
    for module in fsdp_modules(model):
        module.reshard()
    own: dict[str, torch.Tensor] = {}
    try:
        for name, value in values.items():
            local = _local(params[name])
            own[name] = local.clone()
            local.copy_(_shard_of(value, params[name]))
        yield model
    finally:
        for module in fsdp_modules(model):
            module.reshard()
        for name, value in own.items():
            _local(params[name]).copy_(value)


def _local(param: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds of `param` (its shard under FSDP2), to write in place."""
    return param.to_local() if is_sharded(param) else param


def _shard_of(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    local = _local(param)
    value = value.to(device=local.device, dtype=local.dtype)
    if is_sharded(param):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(
            value, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    if value.shape != local.shape:
        raise RuntimeError(f"a value of shape {tuple(value.shape)} for {tuple(local.shape)}")
    return value


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `fully_shard` was applied to, root first (the same order on every rank)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` with every parameter gathered whole, for decoding; resharded on exit.

    A collective on entry (one all-gather per sharded module, in module order on every rank),
    none inside: the engine decodes with the full parameters without communicating per token,
    and the full values exist only while it decodes (the rest of the time each rank holds its
    shards alone). Reshard-after-forward is off inside, so the prefill's forward hooks do not
    free a layer the decode steps (which read the parameters directly) still need. A model
    that is not sharded is yielded as it is.
    """
    modules = fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield model
    finally:
        for module in modules:
            module.reshard()  # frees the gathered values; local, no collective
            # as `shard_model` left it: decoder layers free their parameters after forward, the
            # root keeps them (backward needs them at once), as fully_shard's default does
            module.set_reshard_after_forward(module is not model, recurse=False)


def shard_run_models(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    cfg: ParallelConfig,
    generation_copy: bool = True,
) -> tuple[torch.nn.Module, torch.nn.Module | None, torch.nn.Module | None]:
    """(sharded policy, sharded reference, plain full copy of the policy for generation, or
    None when `generation_copy` is False).

    Only `--fsdp-mixed-precision bf16` asks for the copy (see `distributed.rollout`): the
    in-process engine otherwise decodes with the sharded policy itself, `unsharded` for the
    length of a rollout, and a remote engine needs nothing here. The copy is taken before
    sharding, so it starts with exactly the loaded weights; after each update
    `copy_full_weights` refreshes it.
    """
    import copy

    if generation_copy:
        generation_copy = copy.deepcopy(model).requires_grad_(False)
        # on the meta device on ranks other than 0: given storage, then rank 0's values below
        if is_meta(generation_copy):
            generation_copy.to_empty(device=env.device())
            # to_empty gives the tied LM head storage of its own: tie it to the embedding again
            # (copy_full_weights fills each shared tensor once, under its first name)
            if hasattr(generation_copy, "tie_weights"):
                generation_copy.tie_weights()
        else:
            generation_copy.to(env.device())
    else:
        generation_copy = None
    shard_from_rank0(model, cfg)
    if reference is not None:
        shard_from_rank0(reference, cfg)
    if generation_copy is not None:
        copy_full_weights(model, generation_copy)  # parameters and buffers, gathered
    return model, reference, generation_copy
