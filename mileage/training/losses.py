"""Token log-probs, the PPO-clip policy loss, KL estimators and entropy.

Losses return *sums* over tokens; the actor divides by the number of response tokens in the
whole global batch, so gradient accumulation over micro-batches gives the same update as one
big batch (token-level aggregation).
"""

from __future__ import annotations

import torch

# exp(20) ~ 4.9e8: far enough to never bind in healthy training, close enough that exp() and a
# product with it stay finite in float32 (exp overflows past ~88.7; inf * 0 would be NaN)
LOG_RATIO_CLAMP = 20.0


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) per position (and the entropy of each position's distribution).

    `logits[:, i]` scores `targets[:, i]`. The log-prob is gathered before normalising
    (logit - logsumexp), so the full log-softmax is only built when entropy is requested, and
    with `entropy_grad=False` (entropy only logged) it is built outside autograd, so none of
    its vocabulary-sized intermediates is kept for the backward pass.
    """
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            log_probs = logits - norm.unsqueeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        # The log-ratio is clamped once and the clamped value used in both terms: clamping only
        # the exponential leaves `+ log_ratio` with gradient +1 past the clamp, which pushes the
        # policy *away* from the reference. Past the clamp the gradient is 0 instead.
        clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(-clamped) - 1) + clamped
    raise ValueError(f"unknown KL estimator {kind!r}")


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over response tokens of max(-A*r, -A*clip(r, 1-eps, 1+eps_high)); plus clip statistics."""
    # clamped like the KL so that a zero advantage times an overflowing ratio is 0, not inf*0=NaN
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        stats = {
            "clipfrac": ((clipped > unclipped).float() * mask).sum(),
            "ratio": (ratio * mask).sum(),
        }
    return (per_token * mask).sum(), stats
