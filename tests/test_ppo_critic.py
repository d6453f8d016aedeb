"""The PPO critic: value model construction, value targets, and that training fits the returns."""

from __future__ import annotations

import pytest
import torch

from mileage.errors import UserError
from mileage.training.critic import Critic, CriticConfig, ValueModel, sequence_values
from mileage.training.optimizer import LRSchedule
from mileage.training.packing import Batching


def _batch():
    from mileage.rollout.rollout import Sample
    from mileage.training.batch import pack_samples

    gen = torch.Generator().manual_seed(2)
    samples = []
    for i in range(4):
        prompt = torch.randint(4, 20, (3 + i % 2,), generator=gen).tolist()
        response = torch.randint(4, 20, (1 + i % 3,), generator=gen).tolist()
        samples.append(
            Sample(None, prompt, response, [-1.0] * len(response), "", float(i % 2), True)
        )
    return pack_samples(samples, 0)


def test_value_model_is_the_actor_body_with_a_reproducible_fresh_head(tiny_hf):
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(tiny_hf)
    a = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_hf), seed=7)
    b = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_hf), seed=7)
    c = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_hf), seed=8)
    for name, tensor in actor.model.state_dict().items():
        assert torch.equal(a.body.state_dict()[name], tensor)
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    assert not torch.equal(a.value_head.weight, c.value_head.weight)
    batch = _batch()
    part = batch.slice(0, len(batch))
    assert sequence_values(a, part).shape == part.loss_mask.shape


def test_critic_flags_are_refused_where_they_would_do_nothing():
    with pytest.raises(UserError, match="--critic-save is not supported: mileage saves the critic"):
        CriticConfig(critic_save="/c").validate("ppo")
    with pytest.raises(UserError, match="--critic-lr, --num-critic-only-steps configure the PPO"):
        CriticConfig(critic_lr=1e-3, num_critic_only_steps=2).validate("grpo")
    with pytest.raises(UserError, match="--num-critic-only-steps must be >= 0, got -1"):
        CriticConfig(num_critic_only_steps=-1).validate("ppo")
    CriticConfig(critic_load="/x", critic_lr=1e-3, num_critic_only_steps=2).validate("ppo")


def test_critic_training_fits_the_returns(tiny_hf):
    from transformers import AutoModelForCausalLM

    model = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_hf), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    critic = Critic(model, opt, LRSchedule(1e-2, 0, 0, "constant", 1), 10.0, 1.0, per_token=False)
    batch = _batch()
    batch.returns = batch.rewards[:, None] * batch.loss_mask  # value of every state = its reward
    losses = []
    for _ in range(30):
        batch.values = critic.values(batch, Batching(2))
        losses.append(critic.train_rollout(batch, 4, Batching(2))["value_loss"])
    assert losses[-1] < 0.1 * losses[0]
    assert critic.state_dict() == {"step": 30, "rollouts": 30}
    fitted = critic.values(batch, Batching(4))
    mask = batch.loss_mask.bool()
    assert torch.allclose(fitted[mask], batch.returns[mask], atol=0.25)


def test_actor_with_critic_uses_gae_and_waits_for_the_critic_warmup(tiny_hf):
    from transformers import AutoModelForCausalLM

    from mileage.training.actor import Actor, AlgoConfig
    from mileage.training.advantages import compute_advantages

    value_model = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_hf), seed=0)
    critic = Critic(
        value_model,
        torch.optim.SGD(value_model.parameters(), lr=0.1),
        LRSchedule(0.1, 0, 0, "constant", 1),
        0.2,
        0.0,
        per_token=False,
        critic_only_rollouts=1,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    algo = AlgoConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    actor = Actor(model, opt, LRSchedule(0.1, 0, 0, "constant", 1), algo, 1.0, 2, 0, critic=critic)

    def weights(m):
        return torch.cat([p.detach().flatten() for p in m.parameters()])

    before = weights(model)
    batch = _batch()
    values = critic.values(batch, Batching(4))
    stats = actor.train_rollout(batch)
    want, returns = compute_advantages(
        "ppo", batch.rewards, batch.loss_mask, 2, gamma=0.9, lambd=0.7, values=values
    )
    assert torch.equal(batch.values, values) and torch.allclose(batch.advantages, want)
    assert torch.allclose(batch.returns, returns)
    assert torch.equal(weights(model), before) and actor.step == 0  # critic-only rollout
    assert critic.step == 1 and "value_loss" in stats
    actor.train_rollout(_batch())
    assert not torch.equal(weights(model), before) and actor.step == 1 and critic.step == 2


def test_build_critic_copies_the_actor_and_takes_the_critic_flags(tiny_hf):
    from transformers import AutoModelForCausalLM

    from mileage.training.algo import AlgoConfig
    from mileage.training.critic import build_critic
    from mileage.training.optimizer import OptimConfig

    actor = AutoModelForCausalLM.from_pretrained(tiny_hf)
    cfg = CriticConfig(critic_lr=3e-3, num_critic_only_steps=2)
    algo = AlgoConfig(advantage_estimator="ppo", value_clip=0.5)
    critic = build_critic(cfg, OptimConfig(lr=1e-5), algo, actor, None, str(tiny_hf), 7, 10, 0.5)
    for name, tensor in actor.model.state_dict().items():
        value = critic.model.body.state_dict()[name]
        assert torch.equal(value, tensor) and value.data_ptr() != tensor.data_ptr()
    assert critic.optimizer.param_groups[0]["lr"] == 3e-3 and critic.schedule.peak == 3e-3
    assert critic.critic_only_rollouts == 2 and critic.value_clip == 0.5 and critic.clip_grad == 0.5
    default_lr = build_critic(CriticConfig(), OptimConfig(lr=1e-5), algo, actor, None, "", 7, 10, 1)
    assert default_lr.schedule.peak == 1e-5


def test_async_snapshot_copies_the_critic_too():
    """--async-save writes a copy made at save time: the critic's tensors must be in it, as
    copies (training goes on and changes the live ones), reusing the previous snapshot's buffers."""
    from mileage.checkpoint.store import CheckpointState

    def state(value: float) -> CheckpointState:
        critic = CheckpointState(
            model={"value_head.weight": torch.full((1, 2), value)},
            meta={"rollout_id": 3},
            optimizer={"value_head.weight.exp_avg": torch.full((1, 2), -value)},
        )
        return CheckpointState(model={"w": torch.zeros(2)}, meta={}, critic=critic)

    live = state(1.0)
    first = live.copied()
    live.critic.model["value_head.weight"].add_(5.0)
    assert torch.equal(first.critic.model["value_head.weight"], torch.ones(1, 2))
    assert torch.equal(first.critic.optimizer["value_head.weight.exp_avg"], -torch.ones(1, 2))
    assert first.critic.meta == {"rollout_id": 3}
    second = state(2.0).copied(reuse=first)
    buffer = second.critic.model["value_head.weight"]
    assert buffer.data_ptr() == first.critic.model["value_head.weight"].data_ptr()
    assert torch.equal(buffer, torch.full((1, 2), 2.0))
