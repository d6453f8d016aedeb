"""The policy losses (PPO-clip, dual-clip, GSPO), the value loss, KL estimators, and how
per-token values are reduced to one loss (miles' aggregation). Log-probs and entropies come
from `mileage.training.logprobs`.

Loss functions return *per-token* tensors; a `LossReducer` turns them into the micro-batch's
share of the global batch's loss, so gradient accumulation over micro-batches gives the same
update as one big batch in both aggregation modes.
"""

from __future__ import annotations

import torch

# exp(20) ~ 4.9e8: far enough to never bind in healthy training, close enough that exp() and a
# product with it stay finite in float32 (exp overflows past ~88.7; inf * 0 would be NaN)
LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def _clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.nan_to_num(0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3;
    `low_var_kl` is k3 with the value clamped to [-10, 10], as in miles/verl)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # The log-ratio is clamped once and the clamped value used in both terms: clamping only
        # the exponential leaves `+ log_ratio` with gradient +1 past the clamp, which pushes the
        # policy *away* from the reference. Past the clamp the gradient is 0 instead.
        clamped = _clamp_log_ratio(log_ratio)
        kl = (torch.exp(-clamped) - 1) + clamped
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {kind!r}")


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor):
    """GSPO: each token gets its sequence's mean log-ratio (gradient flows through every token)."""
    per_seq = ((logp - old_logp) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_seq[:, None].expand_as(logp)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
    sequence_level: bool = False,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token max(-A*r, -A*clip(r, 1-eps, 1+eps_high)) and per-token statistics.

    `eps_clip_c` (dual clip, arXiv:1912.09729) bounds the loss of a negative-advantage token
    by -c*A, so one token whose ratio exploded cannot dominate. `sequence_level` uses the GSPO
    ratio (the sequence's mean log-ratio) instead of the token's. `token_weights` multiplies
    each token's term (truncated importance sampling, `--use-tis`).
    """
    log_ratio = sequence_log_ratio(logp, old_logp, mask) if sequence_level else logp - old_logp
    # clamped so that a zero advantage times an overflowing ratio is 0, not inf*0=NaN
    ratio = torch.exp(_clamp_log_ratio(log_ratio))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        dual = torch.minimum(per_token, -eps_clip_c * advantages)
        per_token = torch.where(advantages < 0, dual, per_token)
    if token_weights is not None:
        per_token = per_token * token_weights
    with torch.no_grad():
        stats = {"clipfrac": (clipped > unclipped).float(), "ratio": ratio.detach()}
    return per_token, stats


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token max((v - R)^2, (v_old + clip(v - v_old, +-value_clip) - R)^2) and clip flags."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((values - returns).square(), (clipped - returns).square())
    return loss, ((values - old_values).abs() > value_clip).float().detach()


class LossReducer:
    """Per-token values -> this micro-batch's share of the global batch's loss (miles' meaning).

    Per-sample (miles' default): each sample's masked token mean, summed, divided by the
    number of samples in the global batch. Per-token (`--calculate-per-token-loss`): the sum
    over all response tokens divided by the global batch's token count (each sample counting
    at least one token).
    """

    def __init__(self, mask: torch.Tensor, per_token: bool, global_denominator: float):
        lengths = mask.sum(dim=1).clamp(min=1.0)
        # per-token: weights are the mask itself (x * 1.0 is exact, so the token mean is
        # bit-identical to sum(x * mask) / tokens)
        self.weights = mask if per_token else mask / lengths[:, None]
        self.denominator = global_denominator

    @staticmethod
    def global_denominator(mask: torch.Tensor, per_token: bool) -> float:
        """The divisor for a whole global batch with loss mask `mask`."""
        if per_token:
            return float(mask.sum(dim=1).clamp(min=1.0).sum())
        return float(mask.shape[0])

    def __call__(self, per_token_values: torch.Tensor) -> torch.Tensor:
        return (per_token_values * self.weights).sum() / self.denominator
