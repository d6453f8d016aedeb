"""Advantages, losses, KL estimators and the LR schedule against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mileage.training.advantages import EPS, compute_advantages, grpo_advantages
from mileage.training.losses import kl_estimate, ppo_clip_loss, token_logprobs
from mileage.training.optimizer import LRSchedule


def test_grpo_group_normalisation_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    adv = grpo_advantages(rewards, mask, group_size=4)
    # group 1: mean 0.25, unbiased std sqrt(0.25) = 0.5
    assert adv[0, 0].item() == pytest.approx(0.75 / (0.5 + EPS))
    assert adv[1, 1].item() == pytest.approx(-0.25 / (0.5 + EPS))
    assert adv[0, 2].item() == 0.0  # padding stays zero
    assert torch.all(adv[4:] == 0)  # a group with no variance teaches nothing
    no_std = grpo_advantages(rewards, mask, group_size=4, normalize_std=False)
    assert no_std[0, 0].item() == pytest.approx(0.75) and no_std[1, 0].item() == pytest.approx(
        -0.25
    )


def test_kl_in_reward_shifts_grpo_rewards_before_normalising():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 2)
    token_kl = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    adv = compute_advantages("grpo", rewards, mask, 2, token_kl, kl_coef=1.0, normalize_std=False)
    # shaped rewards: [1 - 1.0, 0 - 0] = [0, 0] -> no advantage left
    assert torch.allclose(adv, torch.zeros(2, 2))


def test_reinforce_plus_plus_returns_and_whitening_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token_kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    adv = compute_advantages("reinforce_plus_plus", rewards, mask, 2, token_kl, kl_coef=0.1)
    # token rewards: row0 [-.01, -.02, -.03 + 1], row1 [-.04, -.05]; returns = reverse cumsum
    returns = [0.94, 0.95, 0.97, -0.09, -0.05]
    mean = sum(returns) / 5
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / 4)
    expected = torch.tensor(
        [
            [(r - mean) / (std + EPS) for r in returns[:3]],
            [(returns[3] - mean) / (std + EPS), (returns[4] - mean) / (std + EPS), 0.0],
        ]
    )
    assert torch.allclose(adv, expected, atol=1e-6)


def test_token_logprobs_and_entropy_match_log_softmax():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    targets = torch.tensor([[0, 2]])
    logp, entropy = token_logprobs(logits, targets, temperature=2.0, with_entropy=True)
    ref = torch.log_softmax(logits / 2.0, dim=-1)
    assert torch.allclose(logp, torch.stack([ref[0, 0, 0], ref[0, 1, 2]])[None])
    assert entropy[0, 1].item() == pytest.approx(math.log(3))


def test_ppo_clip_loss_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))  # ratios
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.3)
    # per token: A>0,r=1.5 -> -min(1.5, 1.3) = -1.3 ; A>0,r=.5 -> -0.5 ; A<0,r=1.5 -> +1.5 ; masked
    assert loss.item() == pytest.approx(-1.3 - 0.5 + 1.5)
    assert stats["clipfrac"].item() == pytest.approx(1.0)  # only the first token is clipped


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)


def test_lr_schedule_warmup_then_decay():
    cosine = LRSchedule(peak=1.0, minimum=0.1, warmup=2, decay_style="cosine", decay_steps=6)
    assert [cosine.lr_at(s) for s in (0, 1)] == [0.5, 1.0]
    assert cosine.lr_at(2) == pytest.approx(1.0)
    assert cosine.lr_at(4) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cosine.lr_at(6) == pytest.approx(0.1) and cosine.lr_at(50) == pytest.approx(0.1)
    linear = LRSchedule(peak=1.0, minimum=0.0, warmup=0, decay_style="linear", decay_steps=4)
    assert [linear.lr_at(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_gradient_accumulation_equals_one_big_batch(tiny_hf):
    """Token-level aggregation: 4 micro-batches of 2 give the update of one batch of 8."""
    from transformers import AutoModelForCausalLM

    from mileage.rollout.rollout import Sample
    from mileage.training.actor import Actor, AlgoConfig
    from mileage.training.batch import pack_samples

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        length = 1 + i % 3
        response = torch.randint(4, 20, (length,), generator=gen).tolist()
        samples.append(Sample(None, [1, 5, 6], response, [-1.0] * length, "", float(i % 2), True))
    weights = []
    for micro in (8, 2):
        model = AutoModelForCausalLM.from_pretrained(tiny_hf)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        algo = AlgoConfig(micro_batch_size=micro)
        actor = Actor(model, opt, LRSchedule(0.1, 0, 0, "constant", 1), algo, 1.0, 2, clip_grad=0)
        actor.train_rollout(pack_samples(samples, 0))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


def test_logged_entropy_builds_no_graph_but_the_bonus_does():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    logp, logged = token_logprobs(logits, targets, with_entropy=True, entropy_grad=False)
    assert logp.requires_grad and not logged.requires_grad
    _, bonus = token_logprobs(logits, targets, with_entropy=True, entropy_grad=True)
    assert bonus.requires_grad and torch.equal(logged, bonus.detach())


def _long_prompt_batch(vocab: int):
    from mileage.rollout.rollout import Sample
    from mileage.training.batch import pack_samples

    gen = torch.Generator().manual_seed(3)
    samples = []
    for i in range(4):
        prompt = torch.randint(4, vocab, (9 + i,), generator=gen).tolist()
        response = torch.randint(4, vocab, (2 + i,), generator=gen).tolist()
        logprobs = [-1.0] * len(response)
        samples.append(Sample(None, prompt, response, logprobs, "", float(i % 2), True))
    return pack_samples(samples, 0)


@pytest.mark.parametrize("with_logits_to_keep", [True, False])
def test_slices_score_only_response_positions_with_the_same_logprobs(tiny_hf, with_logits_to_keep):
    """The trainer skips the prompt columns no row needs; the log-probs it keeps are the full
    forward's, whether the model takes `logits_to_keep` or the logits are cut afterwards."""
    from transformers import AutoModelForCausalLM

    from mileage.training.actor import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    if not with_logits_to_keep:
        full_forward = model.forward

        def forward(input_ids, attention_mask):  # a model without the argument
            return full_forward(input_ids=input_ids, attention_mask=attention_mask)

        model.forward = forward
    batch = _long_prompt_batch(model.config.vocab_size)
    part = batch.slice(0, len(batch))
    assert part.target_offset == 8  # the shortest prompt has 9 tokens
    assert part.loss_mask.shape == (4, batch.loss_mask.shape[1] - 8)
    assert torch.equal(part.loss_mask, batch.loss_mask[:, 8:])
    with torch.no_grad():
        full, _ = sequence_logprobs(model, batch, 0.7)
        kept, _ = sequence_logprobs(model, part, 0.7)
    assert kept.shape == part.loss_mask.shape
    mask = part.loss_mask.bool()
    assert torch.allclose(kept[mask], full[:, 8:][mask], atol=1e-5)


def test_reference_logprobs_land_in_their_own_columns(tiny_hf):
    from transformers import AutoModelForCausalLM

    from mileage.training.actor import Actor, AlgoConfig, sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    algo = AlgoConfig(kl_coef=0.1, micro_batch_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    actor = Actor(model, opt, LRSchedule(0.0, 0, 0, "constant", 1), algo, 1.0, 2, 0, model)
    batch = _long_prompt_batch(model.config.vocab_size)
    actor.prepare(batch, micro=2)
    with torch.no_grad():
        full, _ = sequence_logprobs(model, batch, 1.0)
    mask = batch.loss_mask.bool()
    assert torch.allclose(batch.ref_logprobs[mask], full[mask], atol=1e-5)
