"""The actor's full gradient against a plain-autograd reference written here from the formulas.

The reference runs each sample on its own (no padding, packing, slicing or logits_to_keep),
computes GRPO advantages, the PPO-clip term, the k3 KL-loss term and the entropy bonus token by
token, aggregates them as miles does (each sample's token mean, averaged over the samples; or,
with --calculate-per-token-loss, a token mean over the global batch), and differentiates that.
The actor must give the same gradient for every parameter, with gradient accumulation over
micro-batches.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mileage.training.actor import Actor, AlgoConfig
from mileage.training.batch import pack_samples
from mileage.training.optimizer import LRSchedule

TEMPERATURE, EPS_LOW, EPS_HIGH = 0.7, 0.2, 0.28
KL_COEF, ENTROPY_COEF, GROUP = 0.05, 0.01, 4


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float

    def mask(self) -> list[int]:
        """Every response token is the policy's (pack_samples' per-token loss mask)."""
        return [1] * len(self.response_ids)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def response_logits(model, sample: Sample) -> torch.Tensor:
    """Logits (scaled by the temperature) that predict each response token of one sample."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    logits = model(input_ids=ids).logits[0].float() / TEMPERATURE
    first = len(sample.prompt_ids) - 1
    return logits[first : first + len(sample.response_ids)]


def samples_for(behaviour) -> list[Sample]:
    """8 samples in 2 groups with ragged lengths; log-probs from a perturbed behaviour policy."""
    gen = torch.Generator().manual_seed(7)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    samples = []
    for row, reward in enumerate(rewards):
        prompt = torch.randint(1, 24, (3 + row % 3,), generator=gen).tolist()
        response = torch.randint(1, 24, (2 + (row * 5) % 4,), generator=gen).tolist()
        sample = Sample(prompt, response, [], reward)
        with torch.no_grad():
            logp = torch.log_softmax(response_logits(behaviour, sample), -1)
        sample.logprobs = logp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
        samples.append(sample)
    return samples


def reference_loss(model, reference_model, samples: list[Sample], per_token: bool) -> torch.Tensor:
    rewards = [s.reward for s in samples]
    advantages = []
    for start in range(0, len(rewards), GROUP):
        group = rewards[start : start + GROUP]
        mean, std = statistics.mean(group), statistics.stdev(group)
        advantages += [(r - mean) / (std + 1e-6) for r in group]
    total, tokens, sample_means = torch.zeros(()), 0, []
    for sample, advantage in zip(samples, advantages, strict=True):
        logits = response_logits(model, sample)
        log_probs = torch.log_softmax(logits, -1)
        target = torch.tensor(sample.response_ids)
        logp = log_probs.gather(-1, target[:, None])[:, 0]
        with torch.no_grad():
            ref_logp = torch.log_softmax(response_logits(reference_model, sample), -1)
            ref_logp = ref_logp.gather(-1, target[:, None])[:, 0]
        ratio = torch.exp(logp - torch.tensor(sample.logprobs))
        policy = torch.maximum(
            -advantage * ratio, -advantage * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
        )
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        per_token_loss = policy + KL_COEF * kl - ENTROPY_COEF * entropy
        total = total + per_token_loss.sum()
        tokens += len(sample.response_ids)
        sample_means.append(per_token_loss.mean())
    return total / tokens if per_token else torch.stack(sample_means).mean()


@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
@pytest.mark.parametrize("micro_batch", [8, 2, 1])
def test_actor_gradient_equals_the_reference(micro_batch, per_token):
    model, reference_model = tiny_llama(0), tiny_llama(1).requires_grad_(False)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for param in behaviour.parameters():
            param.add_(0.3 * torch.randn_like(param))
    samples = samples_for(behaviour)

    expected_model = copy.deepcopy(model)
    reference_loss(expected_model, reference_model, samples, per_token).backward()
    expected = {n: p.grad for n, p in expected_model.named_parameters()}

    algo = AlgoConfig(
        eps_clip=EPS_LOW, eps_clip_high=EPS_HIGH, use_kl_loss=True, kl_loss_coef=KL_COEF,
        kl_loss_type="k3", entropy_coef=ENTROPY_COEF, micro_batch_size=micro_batch,
        calculate_per_token_loss=per_token,
    )  # fmt: skip
    schedule = LRSchedule(peak=0.0, minimum=0.0, warmup=0, decay_style="constant", decay_steps=1)
    actor = Actor(
        model, torch.optim.SGD(model.parameters(), lr=0.0), schedule, algo,
        temperature=TEMPERATURE, group_size=GROUP, clip_grad=0.0, reference=reference_model,
    )  # fmt: skip
    stats = actor.train_rollout(pack_samples(samples, pad_id=0))
    # the batch exercises both sides of the clip, so the reference's max() matters
    assert 0 < stats["clipfrac"] < 1
    for name, param in model.named_parameters():
        assert param.grad is not None and expected[name].abs().sum() > 0, name
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
