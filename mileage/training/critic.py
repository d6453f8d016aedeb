"""The PPO critic: a value model (the actor's architecture, its LM head replaced by a scalar
value head) and its training on GAE returns with value clipping (miles' `value_loss`).

Values live in the same "target" space as log-probs: `values[:, i]` is the value of the state
whose next token is `targets[:, i]`.

The critic is checkpointed inside the actor's checkpoint (iter_N/critic/: model, optimizer,
meta; its counters in the actor's trainer_state.json), written in the same staging directory, so
the one rename and tracker move that commit the actor commit the critic too: a resume can never
pair an actor of rollout N with a critic of N-1. That is why mileage has no --critic-save
directory (miles: --save + "_critic"); see docs/flags.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mileage import ranks
from mileage.checkpoint.layout import CRITIC_DIR
from mileage.checkpoint.store import CheckpointState
from mileage.checkpoint.tensors import (
    MODEL_DIR,
    load_optimizer_tensors,
    load_tensors,
    optimizer_tensors,
)
from mileage.config import option
from mileage.errors import UserError
from mileage.models.hf import empty_causal_lm
from mileage.models.tensors import model_tensors
from mileage.precision import autocast, precision_of, set_precision
from mileage.seeding import derive_seed
from mileage.training.batch import TrainBatch
from mileage.training.losses import LossReducer, value_loss
from mileage.training.optimizer import LRSchedule, OptimConfig, build_optimizer, build_schedule
from mileage.training.packing import Batching, packed_values


@dataclass
class CriticConfig:
    critic_load: str | None = option(
        None,
        "PPO: initial critic weights, from the --save directory of a PPO run "
        "(default: the actor's starting weights + a fresh value head)",
    )
    critic_save: str | None = option(
        None,
        "not supported: the critic is saved inside each --save checkpoint (iter_N/critic/), so "
        "actor and critic commit as one",
    )
    critic_lr: float | None = option(None, "PPO: critic learning rate (default: --lr)")
    num_critic_only_steps: int = option(
        0, "PPO: first rollouts in which only the critic trains (the actor is frozen)"
    )

    def validate(self, advantage_estimator: str) -> None:
        if self.critic_save is not None:
            raise UserError(
                "--critic-save is not supported: mileage saves the critic inside each --save "
                "checkpoint (iter_N/critic/) so that actor and critic commit as one"
            )
        if self.num_critic_only_steps < 0:
            raise UserError(
                f"--num-critic-only-steps must be >= 0, got {self.num_critic_only_steps}"
            )
        if self.critic_lr is not None and self.critic_lr < 0:
            raise UserError(f"--critic-lr must be >= 0, got {self.critic_lr}")
        given = [
            flag
            for flag, on in (
                ("--critic-load", self.critic_load is not None),
                ("--critic-lr", self.critic_lr is not None),
                ("--num-critic-only-steps", self.num_critic_only_steps != 0),
            )
            if on
        ]
        if given and advantage_estimator != "ppo":
            raise UserError(
                f"{', '.join(given)} configure the PPO critic; --advantage-estimator "
                f"{advantage_estimator} has none (use --advantage-estimator ppo)"
            )


class ValueModel(torch.nn.Module):
    """The actor's transformer body and a `hidden -> 1` value head."""

    def __init__(self, causal_lm: torch.nn.Module, seed: int):
        super().__init__()
        self.body = getattr(causal_lm, causal_lm.base_model_prefix)
        hidden = causal_lm.config.hidden_size
        dtype = next(self.body.parameters()).dtype
        # a fresh head, drawn from its own indexed generator so a run's critic is reproducible
        # (built on "meta" first: nn.Linear's own init would draw from the global RNG)
        self.value_head = torch.nn.Linear(hidden, 1, bias=False, device="meta", dtype=dtype)
        self.value_head.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(derive_seed(seed, "value_head", 0))
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, hidden**-0.5, generator=gen)
        # drawn on the CPU (the same values on any device), then beside the body
        self.value_head.to(next(self.body.parameters()).device)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        # kwargs: a packed forward's positions and sequence bounds (`mileage.training.packing`)
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, **kwargs
        ).last_hidden_state
        # a copy, not a view (squeeze; float() of fp32 is the same tensor): FSDP2 hooks its
        # backward on a sharded model's output, and on a view an in-place op would drop the hook
        return self.value_head(hidden).squeeze(-1).float().clone()


def sequence_values(model: ValueModel, batch: TrainBatch) -> torch.Tensor:
    """Values at target columns from `target_offset` on, shaped like the batch's loss mask."""
    if batch.packed:
        return packed_values(model, batch)
    with autocast(model):
        values = model(batch.input_ids, batch.attention_mask)
    return values[:, batch.target_offset : batch.input_ids.shape[1] - 1]


class Critic:
    """Value model + optimizer; `step` counts its optimizer steps, `rollouts` its rollouts."""

    def __init__(
        self,
        model: ValueModel,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        value_clip: float,
        clip_grad: float,
        per_token: bool,
        critic_only_rollouts: int = 0,
    ):
        self.model = model
        self.critic_only_rollouts = critic_only_rollouts
        self.optimizer = optimizer
        self.schedule = schedule
        self.value_clip = value_clip
        self.clip_grad = clip_grad
        self.per_token = per_token
        self.step = 0
        self.rollouts = 0

    @property
    def actor_frozen(self) -> bool:
        """--num-critic-only-steps: the actor waits while the critic warms up (miles' order:
        the critic trains on a rollout before the actor)."""
        return self.rollouts < self.critic_only_rollouts

    @torch.no_grad()
    def values(self, batch: TrainBatch, batching: Batching) -> torch.Tensor:
        """The current critic's values for the whole batch."""
        self.model.eval()
        out = torch.zeros_like(batch.old_logprobs)
        for start, part in batching.parts(batch):
            first = part.target_offset
            values = sequence_values(self.model, part)
            out[start : start + len(part), first : first + values.shape[1]] = values
        return out * batch.loss_mask

    def train_rollout(self, batch: TrainBatch, gbs: int, batching: Batching) -> dict[str, float]:
        """Optimizer steps on the value loss against `batch.returns` (GAE targets)."""
        self.model.train()
        loss_total, clip_total, steps = 0.0, 0.0, 0
        for g_start in range(0, len(batch), gbs):
            mask = batch.loss_mask[g_start : g_start + gbs]
            denominator = LossReducer.global_denominator(mask, self.per_token)
            self.optimizer.zero_grad(set_to_none=True)
            # under torchrun each rank takes its share of the global batch, as the actor does:
            # the sharded critic's gradients are summed over ranks (never averaged), and every
            # rank divides by the whole batch's denominator, so the sum is one process's gradient
            for part in batching.rank_parts(batch, g_start, gbs):
                reduce = LossReducer(part.loss_mask, self.per_token, denominator)
                per_token, clipped = value_loss(
                    sequence_values(self.model, part), part.values, part.returns, self.value_clip
                )
                loss = reduce(per_token)
                loss.backward()
                loss_total += float(loss.detach())
                clip_total += float(reduce(clipped))
            if self.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            lr = self.schedule.lr_at(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
            steps += 1
        self.model.eval()
        self.rollouts += 1
        totals = ranks.sum_over_ranks({"value_loss": loss_total, "value_clipfrac": clip_total})
        return {key: value / steps for key, value in totals.items()}

    def state_dict(self) -> dict:
        return {"step": self.step, "rollouts": self.rollouts}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.rollouts = int(state["step"]), int(state["rollouts"])


def build_value_model(
    actor_model: torch.nn.Module,
    critic_from: str | None,
    config_dir: str,
    seed: int,
    start_from: torch.nn.Module | None = None,
) -> ValueModel:
    """The critic's value model the plan names: weights from `critic_from`/critic/, else a copy
    of the actor's starting weights (call before the actor trains, and under torchrun before
    the actor is sharded; `start_from`: a plain model holding them, for a LoRA actor its merged
    view) with a fresh value head; beside the actor, in its precision. The critic trains all its
    weights, also when the actor trains an adapter."""
    # under torchrun, ranks other than 0 hold the actor on the meta device: so does their critic
    # until it is sharded and given rank 0's values (`parallelize.shard_from_rank0`)
    meta = any(p.is_meta for p in actor_model.parameters())
    if critic_from is None:
        body = copy.deepcopy(start_from if start_from is not None else actor_model)
        body.requires_grad_(True)  # a merged view is frozen; the critic's copy trains
    else:
        body = empty_causal_lm(config_dir, device="meta" if meta else "cpu")
    model = set_precision(ValueModel(body, seed).eval(), precision_of(actor_model))
    if critic_from is not None and not meta:
        load_tensors(Path(critic_from) / CRITIC_DIR / MODEL_DIR, into=model_tensors(model))
    return model.to(next(actor_model.parameters()).device)  # the critic trains where the actor does


def build_critic(
    cfg: CriticConfig,
    optim: OptimConfig,
    algo,
    actor_model: torch.nn.Module,
    critic_from: str | None,
    config_dir: str,
    seed: int,
    total_steps: int,
    clip_grad: float,
    model: ValueModel | None = None,
) -> Critic:
    """The critic with its optimizer; `model` is its value model when already built (and
    sharded, under torchrun), else `build_value_model` builds it from the other arguments."""
    if model is None:
        model = build_value_model(actor_model, critic_from, config_dir, seed)
    lr = optim.lr if cfg.critic_lr is None else cfg.critic_lr
    return Critic(
        model,
        build_optimizer(model, optim, lr=lr),
        replace(build_schedule(optim, total_steps), peak=lr),
        algo.value_clip,
        clip_grad,
        algo.calculate_per_token_loss,
        critic_only_rollouts=cfg.num_critic_only_steps,
    )


def critic_checkpoint_state(critic: Critic, meta: dict) -> CheckpointState:
    """The critic's part of a checkpoint (its counters go into the actor's trainer state)."""
    return CheckpointState(
        model=model_tensors(critic.model),
        meta=meta,
        optimizer=optimizer_tensors(critic.model, critic.optimizer),
    )


def restore_critic_optimizer(critic: Critic, checkpoint: str) -> None:
    """A resume's critic optimizer state (its counters are a registered checkpoint part)."""
    load_optimizer_tensors(Path(checkpoint) / CRITIC_DIR, critic.model, critic.optimizer)
