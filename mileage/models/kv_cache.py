"""Key/value caches whose rows can be shared: one row computed per distinct prompt, then copied.

GRPO samples each prompt n times. The engine prefills each distinct prompt once, and the trainer
runs each distinct prompt's forward once per micro-batch (`mileage.training.shared_prompt`);
both then give every sample its prompt's cached keys and values with `expand_rows`. Under
autograd the copy is an `index_select`, whose backward sums the samples' gradients back into
their prompt's row: the same gradient as computing the prompt once per sample.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def shareable_cache(config) -> DynamicCache | None:
    """An empty cache for a model with `config`, or None if any of its layers keeps more than
    the full keys and values (sliding-window and linear-attention layers drop or fold tokens,
    so their rows cannot be copied and extended like this)."""
    cache = DynamicCache(config=config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    return cache


def expand_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Give `cache` one row per entry of `rows` (an index into its current rows)."""
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:  # other layers keep more state than keys/values
            raise TypeError(f"cannot share rows of a {type(layer).__name__}")
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)
