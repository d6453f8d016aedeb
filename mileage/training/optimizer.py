"""AdamW and the learning-rate schedule.

The LR is a pure function of the optimizer step (`LRSchedule.lr_at`). The step counter lives in
the optimizer state, so there is no scheduler object that could be stepped twice on resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mileage.config import option


@dataclass
class OptimConfig:
    lr: float = option(1e-6, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the end of decay")
    lr_warmup_iters: int = option(0, "optimizer steps of linear warmup from 0")
    lr_decay_style: str = option(
        "linear", "LR shape after warmup", choices=("constant", "linear", "cosine")
    )
    lr_decay_iters: int | None = option(None, "optimizer steps until --min-lr (default: whole run)")
    weight_decay: float = option(
        0.01, "AdamW weight decay (matrices only; biases and norm weights are not decayed)"
    )
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.999, "AdamW beta2")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    clip_grad: float = option(1.0, "max global gradient norm (0 disables clipping)")


@dataclass(frozen=True)
class LRSchedule:
    peak: float
    minimum: float
    warmup: int
    decay_style: str
    decay_steps: int

    def lr_at(self, step: int) -> float:
        """LR for optimizer step `step` (0-based)."""
        if self.warmup and step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.decay_style == "constant":
            return self.peak
        span = max(1, self.decay_steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.decay_style == "linear":
            scale = 1.0 - progress
        else:
            scale = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.minimum + (self.peak - self.minimum) * scale


def build_schedule(cfg: OptimConfig, total_steps: int) -> LRSchedule:
    return LRSchedule(
        peak=cfg.lr,
        minimum=cfg.min_lr,
        warmup=cfg.lr_warmup_iters,
        decay_style=cfg.lr_decay_style,
        decay_steps=cfg.lr_decay_iters or total_steps,
    )


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, lr: float | None = None
) -> torch.optim.AdamW:
    # as Megatron: weight decay on matrices only, never on biases or norm weights
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # fused: one pass over each parameter, its gradient and moments per step instead of one per
    # elementwise op (3-4x faster than the per-tensor loop on SmolLM2, bench/optimizer.py). It
    # is elementwise, so its values do not depend on how parameters are grouped or sharded
    # (tests/test_optimizer.py): a resume, and a resharded one, see the same arithmetic.
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr if lr is None else lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=True,
    )
