"""How a run's models and engine are laid out over torchrun ranks (FSDP2), in one place.

`components.build_run` builds the same parts for one process or many; under torchrun it loads
weights through `load_on_rank0` and then hands the unsharded parts to `distribute_run`, which
shards them and wraps the engine for the ranks:
- an in-process engine decodes with the gathered shards (a plain copy is kept only under bf16
  mixed precision, `distributed/rollout.py` says why);
- colocated vLLM runs in every rank's process (`ColocatedOnEveryRank`);
- a remote engine is driven by rank 0 (`RemoteEngineOnRank0`), and with LoRA rank 0 gathers the
  adapter from the shards and sends it (`ShardedLoraSync`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mileage.distributed import env
from mileage.distributed.colocated import ColocatedOnEveryRank
from mileage.distributed.coordination import stop_together
from mileage.distributed.lora_remote import ShardedLoraSync
from mileage.distributed.parallelize import ParallelConfig, shard_from_rank0, shard_run_models
from mileage.distributed.remote import RemoteEngineOnRank0
from mileage.distributed.rollout import ShardedGenerationEngine
from mileage.models.hf import empty_causal_lm
from mileage.rollout.engines.colocated import ColocatedVLLM


def load_on_rank0(load: Callable[[], torch.nn.Module], config_dir: str) -> torch.nn.Module:
    """`load()` on rank 0 only; the other ranks build the architecture on the meta device (no
    storage) and get their shards of rank 0's values when the model is sharded
    (`shard_from_rank0`), so no rank but 0 ever holds the full model. A failure on rank 0 stops
    every rank with its line."""
    model = stop_together(lambda: load() if env.is_main() else None)
    return model if env.is_main() else empty_causal_lm(config_dir, device="meta")


def distribute_run(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    value_model: torch.nn.Module | None,
    engine,
    lora,
    parallel: ParallelConfig,
    n_samples_per_prompt: int,
    from_tensor: bool,
    adapters: bool,
    log,
):
    """(sharded policy, reference, engine for all ranks). A LoRA run's reference is the sharded
    policy itself, run with its adapter off, so it is passed through as it is; the critic's
    value model is sharded like the actor, in place. `adapters`: the remote engine takes LoRA
    adapters (else it gets merged weights); `from_tensor`: --lora-sync-from-tensor."""
    local = engine is not None and engine.in_process
    keep_copy = local and parallel.fsdp_mixed_precision != "none"
    model, sharded_reference, generation_copy = shard_run_models(
        model, None if lora else reference, parallel, generation_copy=keep_copy
    )
    reference = reference if lora else sharded_reference
    if value_model is not None:  # saved as shards in critic/
        shard_from_rank0(value_model, parallel)
    if engine is None:
        return model, reference, None
    if isinstance(engine, ColocatedVLLM):  # vLLM in every rank's process (colocated.py: why)
        return model, reference, ColocatedOnEveryRank(engine, lora)
    if not local and lora is not None:
        return model, reference, ShardedLoraSync(engine, lora, from_tensor, log, adapters)
    if not local:  # rank 0 drives the servers; no copy of the policy is kept
        return model, reference, RemoteEngineOnRank0(engine)
    engine.model = model if generation_copy is None else generation_copy
    engine = ShardedGenerationEngine(
        engine,
        n_samples_per_prompt,
        loss_precision_matches=parallel.fsdp_mixed_precision == "none",
    )
    return model, reference, engine
