"""Off-policy corrections of the engine/trainer mismatch beyond plain TIS, with miles' names.

All work on log-probs in target space (`[N, T]`, zero outside `mask`). With r the ratio
exp(trainer - engine), per token (`--tis-level token`) or per sequence (`sequence`: the
exp of the summed log-ratio over the sequence's response tokens, shared by its tokens):
- `--tis-mode truncate` (TIS): weight clamp(r, low, high); every token trains.
- `--tis-mode mask` (MIS, rejection IS; at token level IcePop's two-sided mask): a token (or a
  whole sequence) whose r lies outside [low, high] is rejected; the others are weighted by r.
  Rejected tokens leave the loss mask, so they count in neither the numerator nor the
  denominator of any loss term (slime#657: a zero weight alone would still dilute the mean).
- `--custom-tis-function-path`: fn(config, trainer_logprobs, engine_logprobs, mask) ->
  (weights, mask, metrics); miles' `vanilla_tis_function` and `icepop_function` paths name the
  built-in token-level truncate and mask.
OPSM (`--use-opsm`, DeepSeek-V3.2's off-policy sequence masking): a sequence with negative
advantage whose mean log-ratio old - current exceeds `--opsm-delta` gets no policy-gradient
term; computed inside the loss, where the current log-probs are known.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MILES_VANILLA_TIS = "miles.backends.training_utils.loss_hub.corrections.vanilla_tis_function"
MILES_ICEPOP = "miles.backends.training_utils.loss_hub.corrections.icepop_function"

TisFunction = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]


def log_ratio(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, level: str):
    """Per-token log r (token level) or each sequence's summed log r on its tokens."""
    diff = (trainer - engine) * mask
    if level == "sequence":
        return diff.sum(dim=1, keepdim=True).expand_as(diff) * mask
    return diff


def is_weights(
    trainer: torch.Tensor,
    engine: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    low: float = 0.0,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights, the loss mask with rejected tokens removed, metrics) for TIS / MIS / IcePop."""
    ratio = torch.exp(log_ratio(trainer, engine, mask, level))
    tokens = mask.sum().clamp(min=1.0)
    if mode == "truncate":
        weights = ratio.clamp(low, high) * mask
        kept = mask
        changed = (weights != ratio) & mask.bool()
    else:
        inside = (ratio >= low) & (ratio <= high)
        kept = mask * inside
        weights = ratio * kept
        changed = ~inside & mask.bool()
    metrics = {
        "tis_mean": float((ratio * mask).sum() / tokens),
        "tis_clipfrac": float(changed.float().sum() / tokens),
    }
    if mode != "truncate":
        metrics["tis_rejected_frac"] = metrics["tis_clipfrac"]
    return weights, kept, metrics


def mismatch_metrics(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict:
    """miles' --get-mismatch-metrics: how far the engine's log-probs are from the trainer's."""
    tokens = mask.sum().clamp(min=1.0)
    diff = (engine - trainer) * mask
    k3 = (torch.exp(diff) - 1 - diff) * mask  # KL(trainer || engine) per token, >= 0
    seq_tokens = mask.sum(dim=1).clamp(min=1.0)
    return {
        "mismatch_k3_kl": float(k3.sum() / tokens),
        "mismatch_k1_kl": float(-diff.sum() / tokens),
        "mismatch_seq_ppl_ratio": float(torch.exp(-diff.sum(dim=1) / seq_tokens).mean()),
    }


def opsm_keep(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """OPSM's per-row keep mask [N, 1]: 0 for a sequence with a negative advantage whose mean
    log-ratio old - current over its tokens exceeds `delta`."""
    tokens = mask.sum(dim=1).clamp(min=1.0)
    seq_kl = ((old_logprobs - logp.detach()) * mask).sum(dim=1) / tokens
    # a sequence's advantage: its tokens share it (GRPO); the mean covers per-token estimators
    advantage = (advantages * mask).sum(dim=1) / tokens
    drop = (advantage < 0) & (seq_kl > delta)
    return (~drop).float()[:, None]
