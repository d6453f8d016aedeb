"""The flags of `mileage train-async` (miles' names and meanings) and the schedule they fix.

The schedule is what makes an async run exact: which weights generate which rollout is a pure
function of counters, never of thread or server timing.

- Rollouts are generated in *slots* p = 0, 1, 2, ... in data order; slot p's sampling is
  seeded by (seed, p) exactly as `mileage train` seeds rollout p.
- The engine holds the weights of E(t) = K * floor(t / K) trained rollouts once the trainer has
  trained t (`--update-weights-interval K`: the engine is synced after every K-th rollout).
- Slot p is generated with the weights the engine holds when the trainer has trained
  max(0, p - L) rollouts, L being how far generation may run ahead (`lead`): 1 for one-step-off,
  min(S, buffer capacity) for `--fully-async --max-weight-staleness S`, so S = 0 is `train`.
  All slots of one engine version are submitted as soon as the engine holds it, so a
  checkpoint after rollout N holds every slot generated with weights older than N's update,
  and every later slot needs weights the resumed trainer will produce itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from mileage.config import option
from mileage.errors import UserError

CORRECTIONS = ("decoupled", "tis", "none")


@dataclass
class AsyncConfig:
    fully_async: bool = option(
        False,
        "fully async: a producer keeps generating up to --max-weight-staleness rollouts ahead "
        "while the trainer drains completed groups in submission order",
    )
    max_weight_staleness: int | None = option(
        None,
        "fully async: groups generated more than S weight updates before the one they train "
        "in are handed to --async-unused-samples-handler; also how far generation runs ahead "
        "(miles default: None, no filtering)",
    )
    update_weights_interval: int = option(
        1, "hand the trainer's weights to the engine after every K-th rollout (miles default 1)"
    )
    async_max_concurrent_samples: int | None = option(
        None,
        "fully async: samples generating at once (default: one rollout's worth, "
        "rollout_batch_size * n_samples_per_prompt); a multiple of that runs that many "
        "rollouts' generation concurrently",
    )
    async_data_buffer_capacity_factor: float = option(
        2.0,
        "fully async: finished groups held ahead of training, as a multiple of "
        "--rollout-batch-size (miles default 2.0); bounds how far generation runs ahead",
    )
    async_unused_samples_handler: str = option(
        "drop",
        "fully async: what happens to a group staler than --max-weight-staleness: drop it, or "
        "retry (its prompt is generated again, before new data)",
        choices=("drop", "retry"),
    )
    off_policy_correction: str | None = option(
        None,
        "how the loss corrects for samples of older weights (generation ran ahead): decoupled "
        "(AReaL's decoupled PPO, the default), tis (truncated importance sampling) or none",
        choices=CORRECTIONS,
    )
    keep_old_actor: bool = option(
        False,
        "keep the rollout model on the training process (miles): the trainer keeps the weights "
        "each untrained sample was generated with and recomputes the PPO ratio's denominator "
        "with them; the off-policy correction instead of --off-policy-correction",
    )
    behav_imp_weight_cap: float | None = option(
        5.0,
        "decoupled: tokens whose importance weight proximal/behaviour exceeds this are left out "
        "of the loss (AReaL's behav_imp_weight_cap)",
    )

    @property
    def correction(self) -> str:
        """The off-policy correction in force: keep-old-actor, decoupled (default), tis, none."""
        if self.keep_old_actor:
            return "keep-old-actor"
        return self.off_policy_correction or "decoupled"

    def lead(self, rollout_batch_size: int) -> int:
        """How many rollouts generation runs ahead of training (L in the module docstring)."""
        if not self.fully_async:
            return 1  # one-step-off
        capacity = max(1, int(self.async_data_buffer_capacity_factor * rollout_batch_size))
        ahead = capacity // rollout_batch_size
        return ahead if self.max_weight_staleness is None else min(self.max_weight_staleness, ahead)

    def workers(self, samples_per_rollout: int) -> int:
        """Slots generating at once."""
        if self.async_max_concurrent_samples is None:
            return 1
        return self.async_max_concurrent_samples // samples_per_rollout

    def engine_rollouts(self, trained: int) -> int:
        """E(t): trained rollouts in the weights the engine holds once the trainer trained t."""
        return self.update_weights_interval * (trained // self.update_weights_interval)

    def last_slot_of_version(self, engine_rollouts: int, rollout_batch_size: int) -> int:
        """The last slot generated with the engine weights of `engine_rollouts` rollouts."""
        return engine_rollouts + self.update_weights_interval - 1 + self.lead(rollout_batch_size)

    def corrects(self, rollout_batch_size: int) -> bool:
        """Whether samples can come from older weights than the trainer's, so the loss corrects."""
        return self.lead(rollout_batch_size) > 0 or self.update_weights_interval > 1

    def validate(self, rollout_batch_size: int, samples_per_rollout: int) -> None:
        if self.max_weight_staleness is not None and not self.fully_async:
            raise UserError(
                "--max-weight-staleness only applies with --fully-async (one-step-off train-async "
                "always trains on weights exactly one update old)"
            )
        if self.max_weight_staleness is not None and self.max_weight_staleness < 0:
            raise UserError(f"--max-weight-staleness must be >= 0, got {self.max_weight_staleness}")
        if self.update_weights_interval <= 0:
            raise UserError(
                f"--update-weights-interval must be positive, got {self.update_weights_interval}"
            )
        if self.async_data_buffer_capacity_factor <= 0:
            raise UserError(
                "--async-data-buffer-capacity-factor must be positive, got "
                f"{self.async_data_buffer_capacity_factor}"
            )
        concurrent = self.async_max_concurrent_samples
        if concurrent is not None and (concurrent <= 0 or concurrent % samples_per_rollout):
            raise UserError(
                f"--async-max-concurrent-samples must be a positive multiple of one rollout's "
                f"samples ({samples_per_rollout}), got {concurrent}: a rollout is generated as "
                "one seeded unit, so that its samples do not depend on what ran beside it"
            )
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1.0:
            raise UserError(
                f"--behav-imp-weight-cap must be above 1, got {self.behav_imp_weight_cap}"
            )
        if self.keep_old_actor and self.off_policy_correction is not None:
            raise UserError(
                "--keep-old-actor is itself the off-policy correction (PPO's ratio against the "
                "kept weights that generated each sample); leave out --off-policy-correction"
            )
        if self.corrects(rollout_batch_size) and self.correction == "none":
            raise UserError(
                "--off-policy-correction none with samples from older weights (staleness above "
                "0): choose decoupled or tis (or --keep-old-actor), or --fully-async --max-weight-staleness 0 with "
                "--update-weights-interval 1 for on-policy training"
            )
