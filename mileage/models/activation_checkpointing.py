"""Activation checkpointing per decoder layer (`--gradient-checkpointing`, miles' FSDP flag).

A training forward keeps every layer's intermediate tensors for the backward: for SmolLM2 about
1.7 MB per token in fp32, most of a step's memory (docs/memory.md). Checkpointed, each decoder
layer keeps only its input, and the backward runs the layer's forward again to rebuild the rest:
one more forward per step, for a fraction of the memory.

It is Hugging Face's own mechanism (`activation_checkpointing_enable`), non-reentrant
(`torch.utils.checkpoint`, `use_reentrant=False`): parameter names, the state dict and FSDP2's
sharding stay as they are (FSDP2 skips its forward hooks while a backward recomputes, so the
layer is gathered once), inputs need not require grad (a LoRA policy's frozen embeddings), and
the recompute restores the RNG state the forward saw, so dropout (LoRA's included) draws the
same masks and the gradients equal the uncheckpointed ones. It acts only in a training-mode
forward with grad: generation and the no-grad passes run as before.
"""

from __future__ import annotations

import torch

from mileage.errors import UserError


def enable_activation_checkpointing(*models: torch.nn.Module | None) -> int:
    """Checkpoint each decoder layer of every Hugging Face model inside `models` (a causal LM,
    a PEFT-wrapped one, a critic's body); returns how many layers now are. A model with none
    that can be is refused: the flag would do nothing."""
    from transformers import PreTrainedModel

    count = 0
    for model in models:
        if model is None:
            continue
        enabled: list[str] = []  # the outermost Hugging Face models: each covers what it holds
        for name, module in model.named_modules():
            inside = any(name.startswith(f"{outer}.") or not outer for outer in enabled)
            if inside or not isinstance(module, PreTrainedModel):
                continue
            if module.supports_gradient_checkpointing:
                module.activation_checkpointing_enable({"use_reentrant": False})
                enabled.append(name)
        layers = checkpointed_layers(model)
        if not layers:
            raise UserError(
                f"--gradient-checkpointing: {type(model).__name__} has no decoder layer that "
                "Hugging Face can checkpoint; leave the flag off for this model"
            )
        count += layers
    return count


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many of `model`'s decoder layers recompute their forward in the backward."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(
        1
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    )
