"""Numerical edge cases of the KL estimators and the PPO loss far from the reference/old policy."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mileage.training.losses import kl_estimate, ppo_clip_loss


def test_k3_gradient_never_pushes_away_from_the_reference():
    """logp far below ref: the k3 gradient w.r.t. logp must not be positive (it was +1 when only
    the exponential was clamped, so the KL loss pushed the policy further away)."""
    logp = torch.tensor([-26.0, -22.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -1.0])
    kl_estimate(logp, ref, "k3").sum().backward()
    grad = logp.grad
    assert torch.all(grad <= 0), grad
    # inside the clamp range the gradient is the exact one: 1 - exp(ref - logp)
    assert grad[2].item() == pytest.approx(1 - math.exp(2.0))
    # the value keeps growing up to the clamp and is finite
    value = kl_estimate(logp.detach(), ref, "k3")
    assert torch.isfinite(value).all() and value[0] >= value[1] > value[2] > 0


def test_ppo_loss_with_zero_advantage_and_huge_ratio_is_zero_not_nan():
    """An all-equal group has advantage 0; a token whose log-ratio overflows exp() must add 0."""
    old = torch.tensor([[-100.0, -1.0]])
    logp = torch.tensor([[-5.0, -1.0]], requires_grad=True)  # log-ratio 95 > 88.7
    adv = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.2)
    assert (loss * mask).sum().item() == 0.0
    (loss * mask).sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v).all() for v in stats.values())


def test_reference_kl_logging_raises_no_warning(tiny_hf):
    """A reference model makes the actor log the KL; converting it must not warn about grad."""
    from transformers import AutoModelForCausalLM

    from mileage.rollout.rollout import Sample
    from mileage.training.actor import Actor, AlgoConfig
    from mileage.training.batch import pack_samples
    from mileage.training.optimizer import LRSchedule

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf).requires_grad_(False)
    samples = [
        Sample(None, [1, 5, 6], [7, 8], [-1.0, -1.0], "", float(i % 2), True) for i in range(4)
    ]
    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    actor = Actor(model, opt, LRSchedule(0.0, 0, 0, "constant", 1), algo, 1.0, 2, 0, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = actor.train_rollout(pack_samples(samples, 0))
    assert "kl" in stats
