"""Advantage estimators (miles' `--advantage-estimator` values) and advantage whitening.

All functions take per-sample rewards `[N]` and return per-token tensors `[N, T]` over the
response positions given by `mask` (1 = response token), so the loss never needs to know which
estimator produced them. Samples of one prompt are contiguous (`group_size` of them).
"""

from __future__ import annotations

import torch

EPS = 1e-6  # GRPO's std guard (miles and verl)
WHITEN_EPS = 1e-8  # inside the rsqrt of --normalize-advantages (miles)


def grpo_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_size: int, normalize_std: bool = True
) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), broadcast over the response tokens.

    The std is the unbiased one, as in GRPO; with `normalize_std=False` only the group mean is
    subtracted (Dr. GRPO). GSPO uses the same advantages.
    """
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + EPS)
    return centred.reshape(-1, 1) * mask


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """Boolean [N, T]: the last response token of each row."""
    return (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float):
    """G_t = r_t + gamma * G_{t+1} over the response tokens (masked positions are 0)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask


def reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    token_kl: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++: reward at the last token, -kl_coef*KL at every token, discounted returns.
    Not whitened here: miles requires `--normalize-advantages` for it."""
    token_rewards = -kl_coef * token_kl * mask + last_token(mask) * rewards[:, None]
    return discounted_returns(token_rewards, mask, gamma)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    token_kl: torch.Tensor,
    kl_coef: float,
    group_size: int,
) -> torch.Tensor:
    """REINFORCE++-baseline: (r - its group's mean) at every token, minus kl_coef*KL."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1, 1)
    return (centred - kl_coef * token_kl) * mask


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lambd: float,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens; returns (advantages, returns).

    The sequence reward lands on the last response token, the value after it is 0 (no
    bootstrap), and masked positions are skipped: the recursion carries across them.
    """
    token_rewards = torch.zeros_like(values) if token_rewards is None else token_rewards
    token_rewards = token_rewards * mask + last_token(mask) * rewards[:, None]
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    carry = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        live = mask[:, t].bool()
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lambd * carry
        carry = torch.where(live, step, carry)
        next_value = torch.where(live, values[:, t], next_value)
        advantages[:, t] = torch.where(live, step, torch.zeros_like(step))
    return advantages, (advantages + values) * mask


def whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`--normalize-advantages`: (a - mean) / sqrt(var + 1e-8) over the batch's response tokens
    (unbiased variance), as miles' masked whitening."""
    count = mask.sum()
    mean = (advantages * mask).sum() / count
    var = (advantages.square() * mask).sum() / count - mean.square()
    if count >= 2:
        var = var * count / (count - 1)
    return (advantages - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalize_std: bool = True,
    gamma: float = 1.0,
    lambd: float = 1.0,
    values: torch.Tensor | None = None,
    normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch on `--advantage-estimator`; returns (advantages, returns for a critic or None).

    `token_kl` (the reward KL of `--kl-coef`, estimated with `--kl-loss-type`) is used only by
    the estimators that take it in miles (the REINFORCE++ family); the config refuses it
    elsewhere rather than silently ignoring it.
    """
    kl = token_kl if token_kl is not None else torch.zeros_like(mask, dtype=rewards.dtype)
    returns = None
    if estimator in ("grpo", "gspo"):
        advantages = grpo_advantages(rewards, mask, group_size, normalize_std)
    elif estimator == "reinforce_plus_plus":
        advantages = reinforce_plus_plus_returns(rewards, mask, kl, kl_coef, gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = reinforce_plus_plus_baseline_advantages(rewards, mask, kl, kl_coef, group_size)
    elif estimator == "ppo":
        if values is None:
            raise ValueError("ppo advantages need the critic's values")
        advantages, returns = gae(rewards, values, mask, gamma, lambd, -kl_coef * kl)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if normalize:
        advantages = whiten(advantages, mask)
    return advantages, returns
