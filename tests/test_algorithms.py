"""Advantages, losses, KL estimators and the LR schedule against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mileage.training.advantages import EPS, compute_advantages, grpo_advantages
from mileage.training.logprobs import token_logprobs
from mileage.training.losses import (
    LossReducer,
    kl_estimate,
    ppo_clip_loss,
    value_loss,
)
from mileage.training.optimizer import LRSchedule
from mileage.training.packing import Batching


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


def test_reinforce_plus_plus_discounted_returns_and_whitening_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token_kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    adv, returns = compute_advantages(
        "reinforce_plus_plus", rewards, mask, 2, token_kl, kl_coef=0.1, gamma=0.5, normalize=True
    )
    assert returns is None
    # token rewards: row0 [-.01, -.02, -.03 + 1], row1 [-.04, -.05]; G_t = r_t + 0.5 G_{t+1}
    g02 = 0.97
    g01 = -0.02 + 0.5 * g02
    g00 = -0.01 + 0.5 * g01
    g11 = -0.05
    g10 = -0.04 + 0.5 * g11
    values = [g00, g01, g02, g10, g11]
    mean = sum(values) / 5
    var = sum((v - mean) ** 2 for v in values) / 4  # unbiased, as miles' whitening
    scale = 1 / math.sqrt(var + 1e-8)
    expected = torch.tensor(
        [
            [(v - mean) * scale for v in values[:3]],
            [(g10 - mean) * scale, (g11 - mean) * scale, 0.0],
        ]
    )
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_plus_plus_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    token_kl = torch.tensor([[0.5, 1.0], [2.0, 7.0], [0.0, 0.0], [0.0, 0.0]])
    adv, _ = compute_advantages(
        "reinforce_plus_plus_baseline", rewards, mask, 2, token_kl, kl_coef=0.1
    )
    # groups (1, 0) -> centred (0.5, -0.5); (0, 0) -> 0; minus 0.1 * KL per token
    expected = torch.tensor([[0.45, 0.4], [-0.7, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_gae_matches_the_explicit_sum_of_discounted_td_errors():
    """A_t = sum_l (gamma*lambd)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_end = 0."""
    gamma, lambd = 0.9, 0.8
    values = torch.tensor([[0.2, -0.1, 0.4, 0.3], [0.5, 0.1, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([1.0, -1.0])
    adv, returns = compute_advantages(
        "ppo", rewards, mask, 2, gamma=gamma, lambd=lambd, values=values
    )
    for row, length in ((0, 4), (1, 2)):
        v = values[row, :length].tolist() + [0.0]
        r = [0.0] * (length - 1) + [rewards[row].item()]
        delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(length)]
        for t in range(length):
            want = sum((gamma * lambd) ** k * delta[t + k] for k in range(length - t))
            assert adv[row, t].item() == pytest.approx(want, abs=1e-6)
            assert returns[row, t].item() == pytest.approx(want + v[t], abs=1e-6)
    assert adv[1, 2:].abs().sum() == 0 and returns[1, 2:].abs().sum() == 0


def test_normalize_advantages_whitens_grpo_over_the_response_tokens():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, _ = compute_advantages("grpo", rewards, mask, 2, normalize_std=False, normalize=True)
    tokens = [0.5, 0.5, 0.5, -0.5]
    mean = sum(tokens) / 4
    var = sum((t - mean) ** 2 for t in tokens) / 3
    want = [(t - mean) / math.sqrt(var + 1e-8) for t in tokens]
    assert torch.allclose(adv[mask.bool()], torch.tensor(want), atol=1e-6)
    assert adv[1, 1:].abs().sum() == 0


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
    assert (loss * mask).sum().item() == pytest.approx(-1.3 - 0.5 + 1.5)
    assert (stats["clipfrac"] * mask).sum().item() == pytest.approx(1.0)  # only the first token


def test_dual_clip_bounds_negative_advantage_tokens_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[5.0, 5.0, 1.1]]))
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    plain, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)
    dual, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, eps_clip_c=3.0)
    # A<0, r=5: PPO gives max(5, 1.2) = 5, dual clip caps it at -c*A = 3; A>0 untouched;
    # A<0, r=1.1: max(1.1, 1.1) = 1.1 < 3, untouched
    assert plain[0].tolist() == pytest.approx([5.0, -1.2, 1.1])
    assert dual[0].tolist() == pytest.approx([3.0, -1.2, 1.1])


def test_gspo_uses_the_sequence_mean_ratio_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, -0.1, 9.0], [0.05, 0.05, 0.05]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, sequence_level=True)
    r0, r1 = math.exp(0.1), math.exp(0.05)  # mean log-ratio over each row's response tokens
    assert stats["ratio"][0, :2].tolist() == pytest.approx([r0, r0])
    assert loss[0, :2].tolist() == pytest.approx([-r0, -r0])
    assert loss[1].tolist() == pytest.approx([r1] * 3)
    (loss * mask).sum().backward()
    # d/d logp_t of -r0 per token, r0 = exp(mean): each of 2 tokens -> 2 * (-r0 / 2) = -r0
    assert logp.grad[0, :2].tolist() == pytest.approx([-r0, -r0])
    assert logp.grad[0, 2].item() == 0.0


def test_value_loss_clips_around_the_old_value_by_hand():
    values = torch.tensor([1.0, 0.0, 0.5])
    old = torch.tensor([0.5, 0.5, 0.4])
    returns = torch.tensor([1.0, 1.0, 0.0])
    loss, clipped = value_loss(values, old, returns, value_clip=0.2)
    # v=1 (moved +0.5 -> clipped 0.7): max(0, 0.09) ; v=0 (clipped 0.3): max(1, 0.49) ;
    # v=0.5 within the clip: 0.25
    assert loss.tolist() == pytest.approx([0.09, 1.0, 0.25])
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_loss_reducer_per_sample_and_per_token_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    per_sample = LossReducer(mask, False, LossReducer.global_denominator(mask, False))
    per_token = LossReducer(mask, True, LossReducer.global_denominator(mask, True))
    assert per_sample(x).item() == pytest.approx(((1 + 3) / 2 + 5) / 2)
    assert per_token(x).item() == pytest.approx((1 + 3 + 5) / 3)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)
    assert kl_estimate(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d)
    far = kl_estimate(torch.tensor([-30.0]), torch.tensor([-1.0]), "low_var_kl")
    assert far.item() == 10.0  # exp(20) - 1 - 20 clamped to 10


def test_lr_schedule_warmup_then_decay():
    cosine = LRSchedule(peak=1.0, minimum=0.1, warmup=2, decay_style="cosine", decay_steps=6)
    assert [cosine.lr_at(s) for s in (0, 1)] == [0.5, 1.0]
    assert cosine.lr_at(2) == pytest.approx(1.0)
    assert cosine.lr_at(4) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cosine.lr_at(6) == pytest.approx(0.1) and cosine.lr_at(50) == pytest.approx(0.1)
    linear = LRSchedule(peak=1.0, minimum=0.0, warmup=0, decay_style="linear", decay_steps=4)
    assert [linear.lr_at(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_accumulation_equals_one_big_batch(tiny_hf, per_token):
    """Both aggregations: 4 micro-batches of 2 give the update of one batch of 8."""
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
        algo = AlgoConfig(micro_batch_size=micro, calculate_per_token_loss=per_token)
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
    actor.prepare(batch, Batching(2))
    with torch.no_grad():
        full, _ = sequence_logprobs(model, batch, 1.0)
    mask = batch.loss_mask.bool()
    assert torch.allclose(batch.ref_logprobs[mask], full[mask], atol=1e-5)


def test_a_packed_batch_moves_every_tensor_to_the_training_device():
    """Under NCCL the policy lives on the rank's GPU: the packed batch (and everything derived
    from it later) must follow it. "meta" stands in for a GPU here."""
    from mileage.rollout.rollout import Sample
    from mileage.training.batch import pack_samples

    samples = [Sample(None, [1, 5], [7, 8], [-0.5, -0.25], "", 1.0, True)] * 2
    batch = pack_samples(samples, 0)
    batch.advantages = torch.ones_like(batch.old_logprobs)
    moved = batch.to(torch.device("meta"))
    tensors = {k: v for k, v in vars(moved).items() if isinstance(v, torch.Tensor)}
    assert set(tensors) >= {
        "input_ids",
        "attention_mask",
        "loss_mask",
        "old_logprobs",
        "advantages",
    }
    assert all(t.device.type == "meta" for t in tensors.values())
    assert moved.ref_logprobs is None and moved.target_offset == batch.target_offset
    assert batch.to(torch.device("cpu")).input_ids is batch.input_ids  # a no-op on the CPU
