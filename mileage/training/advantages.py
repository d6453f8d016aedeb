"""Advantage estimators: group-normalised GRPO and REINFORCE++.

All functions take per-sample rewards `[N]` and return per-token advantages `[N, T]` over the
response positions given by `mask` (1 = response token), so the loss never needs to know which
estimator produced them.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def grpo_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_size: int, normalize_std: bool = True
) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), broadcast over the response tokens.

    Samples of one prompt are contiguous (`group_size` of them). The std is the unbiased one, as
    in GRPO; with `normalize_std=False` only the group mean is subtracted (Dr. GRPO).
    """
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + EPS)
    return centred.reshape(-1, 1) * mask


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, token_kl: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Token returns (reward at the last token, -kl_coef*KL at every token), whitened over the batch."""
    token_rewards = -kl_coef * token_kl * mask
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()
    token_rewards = token_rewards + last * rewards[:, None]
    returns = token_rewards.flip(1).cumsum(1).flip(1) * mask
    valid = returns[mask.bool()]
    mean, std = valid.mean(), valid.std() if valid.numel() > 1 else valid.new_tensor(0.0)
    return (returns - mean) / (std + EPS) * mask


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    token_kl: torch.Tensor | None,
    kl_coef: float,
    normalize_std: bool = True,
) -> torch.Tensor:
    """Dispatch on `--advantage-estimator`; KL in the reward (`--kl-coef`) is applied here."""
    if estimator == "grpo":
        if kl_coef and token_kl is not None:
            rewards = rewards - kl_coef * (token_kl * mask).sum(dim=1)
        return grpo_advantages(rewards, mask, group_size, normalize_std)
    if estimator == "reinforce_plus_plus":
        kl = token_kl if token_kl is not None else torch.zeros_like(mask, dtype=rewards.dtype)
        return reinforce_plus_plus_advantages(rewards, mask, kl, kl_coef)
    raise ValueError(f"unknown advantage estimator {estimator!r}")
