"""Off-policy correction for async training: samples come from older weights than the trainer's.

Three policies meet in an async PPO step: the behaviour policy that generated the tokens (the
engine's log-probs), the proximal policy (the trainer's weights before this rollout's update,
whose log-probs are recomputed here) and the policy being optimised.

AReaL's decoupled PPO objective (Fu et al. 2025, after Hilton et al. 2022) clips the ratio
against the proximal policy and moves the behaviour correction into a separate weight:

    loss_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps, 1 + eps_high))
    r_t = pi_theta(y_t) / pi_prox(y_t),   w_t = pi_prox(y_t) / pi_behav(y_t)

and a token whose w_t exceeds `--behav-imp-weight-cap` is left out of the loss (w_t = 0), as
AReaL does, rather than clamped. That is `ppo_clip_loss` with `old_logprobs` = proximal and
`token_weights` = w. `--off-policy-correction tis` instead clamps w_t to
[--tis-clip-low, --tis-clip] (the trainer/engine mismatch code's TIS).
"""

from __future__ import annotations

import torch


def decoupled_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token w = exp(proximal - behaviour), 0 off the mask and where w > cap; and stats."""
    raw = torch.exp(proximal - behaviour) * mask
    kept = mask if cap is None else mask * (raw <= cap)
    weights = raw * kept
    tokens = mask.sum().clamp(min=1.0)
    stats = {
        "behav_imp_weight_mean": float(weights.sum() / kept.sum().clamp(min=1.0)),
        "behav_imp_weight_capped_frac": float((mask - kept).sum() / tokens),
    }
    return weights, stats
