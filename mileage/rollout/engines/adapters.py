"""A LoRA adapter as remote engines take it: the update the trainer hands them, and whether a
server can take one at all.

An adapter-only sync sends the adapter's tensors (megabytes) instead of the whole model: the
servers hold the base from the first sync on, and each later version is loaded as an adapter
of its own name, `mileage-lora-v<version>` (a new name per version, so a request can never mix
two versions, and a server that missed a version cannot serve the new name); the previous
version is unloaded after the new one is in place. What loads it:
- SGLang (and `mileage serve`): `POST /load_lora_adapter` `{lora_name, lora_path}` from the
  disk, or `/load_lora_adapter_from_tensors` with the tensors in the request
  (`--lora-sync-from-tensor`, `mileage serve` only), then `/update_weight_version`; requests
  carry `lora_path: <name>`;
- vLLM: `POST /v1/load_lora_adapter` `{lora_name, lora_path}` (the server needs
  `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); requests name the adapter as
  their `model`.
A server that cannot take adapters (started without them, or a smaller `--max-lora-rank`) is
given merged weights instead, which the trainer decides and says once (training/lora_sync.py).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import torch

from mileage.rollout.engines.server_info import ServerInfo

NAME_PREFIX = "mileage-lora-v"
# how `/load_lora_adapter_from_tensors` carries tensors to `mileage serve`: safetensors bytes
TENSOR_FORMAT = "safetensors_base64"


def adapter_name(version: int) -> str:
    return f"{NAME_PREFIX}{version}"


@dataclass(frozen=True)
class AdapterUpdate:
    """One version of the adapter, as a PEFT directory (`path`) and, for a tensor update, its
    tensors under PEFT's saved names with its adapter_config.json fields (`config`)."""

    name: str
    path: Path
    config: dict
    tensors: dict[str, torch.Tensor] | None = None


def encode_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """The tensors as base64 safetensors bytes (`mileage serve` decodes them, never a pickle)."""
    from safetensors.torch import save as save_bytes

    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    return base64.b64encode(save_bytes(contiguous)).decode()


class AdapterRefused(Exception):
    """The server cannot take an adapter (its answer says why): sync merged weights instead."""


def sglang_adapter_problem(info: ServerInfo, rank: int, targets: list[str]) -> str | None:
    """Why the SGLang server described by `info` cannot take this run's adapter, or None."""
    if not info.lora:
        return f"{info.url} was started without --enable-lora"
    if info.max_lora_rank is not None and info.max_lora_rank < rank:
        return f"{info.url} has --max-lora-rank {info.max_lora_rank} < --lora-rank {rank}"
    if info.lora_targets is not None and "all" not in info.lora_targets:
        missing = [t for t in targets if t not in info.lora_targets]
        if missing:
            return f"{info.url} has no {','.join(missing)} in its --lora-target-modules"
    return None
