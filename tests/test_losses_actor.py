"""The actor's loss types and the algorithm flags' combinations, against independent references."""

from __future__ import annotations

import sys

import pytest
import torch

from mileage.errors import UserError
from mileage.training.actor import Actor, AlgoConfig, sequence_logprobs
from mileage.training.advantages import compute_advantages
from mileage.training.losses import kl_estimate
from mileage.training.optimizer import LRSchedule
from mileage.training.packing import Batching


def _batch(n: int = 4):
    from mileage.rollout.rollout import Sample
    from mileage.training.batch import pack_samples

    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(n):
        response = torch.randint(4, 20, (1 + i % 3,), generator=gen).tolist()
        samples.append(
            Sample(None, [1, 5, 6], response, [-1.5] * len(response), "", float(i % 2), True)
        )
    return pack_samples(samples, 0)


def _one_sgd_step(tiny_hf, algo: AlgoConfig, reference=None):
    """Weights after one plain SGD step (lr 1, no clipping) of the actor on `_batch()`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    actor = Actor(model, opt, LRSchedule(1.0, 0, 0, "constant", 1), algo, 1.0, 2, 0, reference)
    stats = actor.train_rollout(_batch())
    return torch.cat([p.detach().flatten() for p in model.parameters()]), stats


def _reference_step(tiny_hf, loss_of_logp):
    """The same SGD step computed directly: loss_of_logp(logp, mask) -> scalar."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    batch = _batch()
    part = batch.slice(0, len(batch))
    logp, _ = sequence_logprobs(model, part, 1.0)
    loss_of_logp(logp, part.loss_mask).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_sft_loss_is_the_per_sample_mean_nll(tiny_hf):
    got, stats = _one_sgd_step(tiny_hf, AlgoConfig(loss_type="sft_loss"))

    def nll(logp, mask):  # mean over samples of each sample's token-mean NLL
        return (-(logp * mask).sum(1) / mask.sum(1)).mean()

    assert torch.allclose(got, _reference_step(tiny_hf, nll), atol=1e-6)
    assert stats["sft_loss"] > 0


def test_sft_loss_per_token_is_the_token_mean_nll(tiny_hf):
    got, _ = _one_sgd_step(tiny_hf, AlgoConfig(loss_type="sft_loss", calculate_per_token_loss=True))
    want = _reference_step(tiny_hf, lambda logp, mask: -(logp * mask).sum() / mask.sum())
    assert torch.allclose(got, want, atol=1e-6)


def test_custom_loss_function_is_called_with_the_reducer(tiny_hf, tmp_path, monkeypatch):
    (tmp_path / "my_loss.py").write_text(
        "def loss(algo, batch, logprobs, reduce):\n"
        "    value = reduce(logprobs.square())\n"
        "    return value, {'square': float(value.detach()), 'rows': len(batch)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = AlgoConfig(loss_type="custom_loss", custom_loss_function_path="my_loss:loss")
    algo.validate(2)
    got, stats = _one_sgd_step(tiny_hf, algo)
    want = _reference_step(
        tiny_hf, lambda logp, mask: ((logp.square() * mask).sum(1) / mask.sum(1)).mean()
    )
    assert torch.allclose(got, want, atol=1e-6)
    assert stats["rows"] == 4 and stats["square"] > 0
    sys.modules.pop("my_loss", None)


def test_reward_kl_uses_the_kl_loss_type_estimator(tiny_hf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf).requires_grad_(False)
    algo = AlgoConfig(
        advantage_estimator="reinforce_plus_plus_baseline",
        kl_coef=0.3,
        kl_loss_type="k2",
        normalize_advantages=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    actor = Actor(model, opt, LRSchedule(0.0, 0, 0, "constant", 1), algo, 1.0, 2, 0, reference)
    batch = _batch()
    actor.prepare(batch, Batching(4))
    k2 = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k2")
    want, _ = compute_advantages(
        "reinforce_plus_plus_baseline", batch.rewards, batch.loss_mask, 2, k2, 0.3, normalize=True
    )
    assert torch.allclose(batch.advantages, want)
    k1 = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k1")
    other, _ = compute_advantages(
        "reinforce_plus_plus_baseline", batch.rewards, batch.loss_mask, 2, k1, 0.3, normalize=True
    )
    assert not torch.allclose(batch.advantages, other)  # the estimator matters here


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(kl_coef=0.1, use_kl_loss=True), "not both"),
        (dict(kl_coef=0.1, kl_loss_coef=0.1), "not both"),
        (dict(kl_coef=0.1), "no effect with --advantage-estimator grpo"),
        (dict(advantage_estimator="reinforce_plus_plus"), "needs --normalize-advantages"),
        (dict(eps_clip_c=1.0), "--eps-clip-c must be > 1"),
        (dict(loss_type="custom_loss"), "go together"),
        (dict(custom_loss_function_path="os:getcwd"), "go together"),
        (dict(loss_type="custom_loss", custom_loss_function_path="os:nope"), "no function"),
        (dict(gamma=1.5), "--gamma must be in [0, 1]"),
    ],
)
def test_refused_combinations(flags, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        AlgoConfig(**flags).validate(4)


def test_miles_defaults():
    algo = AlgoConfig()
    assert algo.kl_loss_type == "k1" and not algo.calculate_per_token_loss
    assert (algo.gamma, algo.lambd, algo.value_clip, algo.eps_clip_c) == (1.0, 1.0, 0.2, None)
    algo.validate(4)  # the defaults are a valid run


def test_both_kl_terms_exit_2_with_one_line(cli, tmp_path):
    out = cli("plan", "--kl-coef", "0.1", "--use-kl-loss", "--save", str(tmp_path / "s"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: give --kl-coef")
