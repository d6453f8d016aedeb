"""A model's tensors by name, each shared tensor once: what checkpoints store and what weight
syncs send. Only torch: checkpoint code imports it without loading transformers."""

from __future__ import annotations

import torch


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each shared tensor once (tied embeddings would otherwise be
    written, hashed and read twice: 0.11 GB of SmolLM2's 0.65 GB)."""
    seen: set[tuple[int, int]] = set()
    tensors = {}
    aliases = tied_aliases(model)
    for name, value in model.state_dict().items():
        if name in aliases:
            continue
        if hasattr(value, "to_local"):  # a DTensor shard: tied names were dropped above
            tensors[name] = value
            continue
        key = (value.untyped_storage().data_ptr(), value.storage_offset())
        if key in seen and value.numel():
            continue
        seen.add(key)
        tensors[name] = value
    return tensors


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names under which an already-listed parameter appears again (tied LM head)."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases
