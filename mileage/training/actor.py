"""The actor: turns one rollout's samples into optimizer steps on the policy.

A rollout of N samples is cut, in order, into global batches of `--global-batch-size` samples
(one optimizer step each), and each global batch into micro-batches of `--micro-batch-size`
whose gradients accumulate. Reference log-probs are computed once per rollout, not per step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from mileage.config import option
from mileage.distributed import env
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.training.advantages import compute_advantages
from mileage.training.batch import TrainBatch
from mileage.training.losses import kl_estimate, ppo_clip_loss, token_logprobs
from mileage.training.optimizer import LRSchedule


@dataclass
class AlgoConfig:
    advantage_estimator: str = option(
        "grpo", "how rewards become advantages", choices=("grpo", "reinforce_plus_plus")
    )
    disable_grpo_std_normalization: bool = option(
        False, "GRPO: subtract the group mean only, do not divide by the group std"
    )
    eps_clip: float = option(0.2, "PPO clip range below 1")
    eps_clip_high: float | None = option(None, "PPO clip range above 1 (default: --eps-clip)")
    kl_coef: float = option(0.0, "KL-to-reference penalty folded into the reward")
    use_kl_loss: bool = option(False, "add a KL-to-reference term to the loss")
    kl_loss_coef: float = option(0.0, "weight of the KL loss")
    kl_loss_type: str = option("k3", "KL estimator for the loss", choices=("k1", "k2", "k3"))
    entropy_coef: float = option(0.0, "entropy bonus weight (entropy is always logged)")
    global_batch_size: int | None = option(
        None, "samples per optimizer step (default: the whole rollout, one step)"
    )
    micro_batch_size: int | None = option(
        None, "samples per forward/backward; gradients accumulate (default: global batch)"
    )

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef != 0.0 or self.use_kl_loss

    def batch_sizes(self, samples_per_rollout: int) -> tuple[int, int]:
        """(global, micro) batch sizes, checked against the rollout size."""
        gbs = self.global_batch_size or samples_per_rollout
        mbs = self.micro_batch_size or gbs
        if gbs <= 0 or mbs <= 0:
            raise UserError(f"batch sizes must be positive (global {gbs}, micro {mbs})")
        if samples_per_rollout % gbs:
            raise UserError(
                f"--global-batch-size {gbs} does not divide the {samples_per_rollout} samples of a "
                f"rollout (--rollout-batch-size x --n-samples-per-prompt)"
            )
        if gbs % mbs:
            raise UserError(f"--micro-batch-size {mbs} does not divide --global-batch-size {gbs}")
        return gbs, mbs


def sequence_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
):
    """Log-probs of `batch.targets` (and entropies), from target column `target_offset` on."""
    keep = batch.input_ids.shape[1] - batch.target_offset
    if _accepts_logits_to_keep(model):
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep
        )
        logits = out.logits[:, :-1]
    else:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logits = out.logits[:, batch.target_offset : -1]
    return token_logprobs(logits, batch.targets, temperature, with_entropy, entropy_grad)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class Actor:
    """Policy + optimizer + step counter; `step` is the number of optimizer steps taken so far."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        algo: AlgoConfig,
        temperature: float,
        group_size: int,
        clip_grad: float,
        reference: torch.nn.Module | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.algo = algo
        self.temperature = temperature
        self.group_size = group_size
        self.clip_grad = clip_grad
        self.reference = reference
        self.step = 0

    @torch.no_grad()
    def _reference_logprobs(self, batch: TrainBatch, micro: int) -> torch.Tensor:
        out = torch.zeros_like(batch.old_logprobs)
        for start in range(0, len(batch), micro):
            part = batch.slice(start, start + micro)
            logp, _ = sequence_logprobs(self.reference, part, self.temperature)
            first = part.target_offset
            out[start : start + micro, first : first + logp.shape[1]] = logp
        return out

    def prepare(self, batch: TrainBatch, micro: int) -> None:
        """Attach reference log-probs (if any) and advantages."""
        token_kl = None
        if self.reference is not None:
            batch.ref_logprobs = self._reference_logprobs(batch, micro)
            token_kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k1")
        batch.advantages = compute_advantages(
            self.algo.advantage_estimator,
            batch.rewards,
            batch.loss_mask,
            self.group_size,
            token_kl,
            self.algo.kl_coef,
            normalize_std=not self.algo.disable_grpo_std_normalization,
        )

    def train_rollout(self, batch: TrainBatch) -> dict[str, float]:
        """All optimizer steps for one rollout; returns token-averaged statistics."""
        gbs, mbs = self.algo.batch_sizes(len(batch))
        self.prepare(batch, mbs)
        self.model.train()
        totals: dict[str, float] = {}
        grad_norms, lrs = [], []
        for g_start in range(0, len(batch), gbs):
            tokens = batch.loss_mask[g_start : g_start + gbs].sum().clamp(min=1.0)
            self.optimizer.zero_grad(set_to_none=True)
            for m_start, m_end in env.micro_batches(g_start, gbs, mbs):  # this rank's share
                stats = self._accumulate(batch.slice(m_start, m_end), tokens)
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
            if self.clip_grad > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            else:
                norm = torch.nn.utils.get_total_norm(
                    [p.grad for p in self.model.parameters() if p.grad is not None]
                )
            lr = self.schedule.lr_at(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
            fault_point("optimizer_step")
            grad_norms.append(float(norm))
            lrs.append(lr)
        self.model.eval()
        totals = env.sum_over_ranks(totals)
        all_tokens = float(batch.loss_mask.sum().clamp(min=1.0))
        result = {key: value / all_tokens for key, value in totals.items()}
        result.update(
            grad_norm=sum(grad_norms) / len(grad_norms), lr=lrs[-1], lrs=lrs, global_step=self.step
        )
        return result

    def _accumulate(self, part: TrainBatch, global_tokens: torch.Tensor) -> dict[str, float]:
        logp, entropy = sequence_logprobs(
            self.model,
            part,
            self.temperature,
            with_entropy=True,
            entropy_grad=self.algo.entropy_coef != 0.0,
        )
        mask = part.loss_mask
        pg_sum, clip_stats = ppo_clip_loss(
            logp,
            part.old_logprobs,
            part.advantages,
            mask,
            self.algo.eps_clip,
            self.algo.eps_clip_high if self.algo.eps_clip_high is not None else self.algo.eps_clip,
        )
        entropy_sum = (entropy * mask).sum()
        loss = pg_sum - self.algo.entropy_coef * entropy_sum
        stats = {"pg_loss": float(pg_sum.detach()), "entropy": float(entropy_sum.detach())}
        if part.ref_logprobs is not None:
            kl_sum = (kl_estimate(logp, part.ref_logprobs, self.algo.kl_loss_type) * mask).sum()
            if self.algo.use_kl_loss:
                loss = loss + self.algo.kl_loss_coef * kl_sum
            stats["kl"] = float(kl_sum)
        else:
            # no reference: report the drift from the generating policy instead
            stats["kl"] = float(((part.old_logprobs - logp.detach()) * mask).sum())
        (loss / global_tokens).backward()
        stats.update({k: float(v) for k, v in clip_stats.items()})
        return stats

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
