"""Builds the engine `--rollout-engine` names."""

from __future__ import annotations

import torch

from mileage.precision import precision_of, torch_dtype_name
from mileage.rollout.engine import LocalEngine
from mileage.rollout.engines.base import Engine
from mileage.rollout.engines.config import EngineConfig


def build_engine(
    cfg: EngineConfig, model: torch.nn.Module, pad_id: int, eos_id: int, config_dir: str, log
) -> Engine:
    if cfg.rollout_engine == "local":
        return LocalEngine(model, pad_id, eos_id)
    vocab = model.config.vocab_size
    if cfg.rollout_engine == "sglang":
        from mileage.rollout.engines.sglang import SGLangEngine

        return SGLangEngine(
            cfg.rollout_url,
            vocab,
            cfg.rollout_timeout,
            cfg.rollout_attempts,
            cfg.rollout_sync_timeout,
            cfg.rollout_weights_dir,
            broadcast_from=(
                cfg.rollout_weight_sync_address if cfg.rollout_weight_sync == "broadcast" else None
            ),
            concurrency=cfg.sglang_server_concurrency,
            allow_nondeterministic=cfg.allow_nondeterministic_rollout,
            buffer_size=cfg.update_weight_buffer_size,
            log=log,
        )
    dtype = torch_dtype_name(precision_of(model))
    if cfg.colocate:
        from mileage.rollout.engines.colocated import ColocatedVLLM

        return ColocatedVLLM(cfg, vocab, eos_id, config_dir, log, dtype)
    from mileage.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(cfg, vocab, eos_id, config_dir, log, dtype=dtype)
