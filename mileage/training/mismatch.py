"""The trainer/engine log-prob mismatch: measured every rollout, optionally corrected.

An engine's log-probs of its sampled tokens differ from the trainer's for the same weights
(other kernels, other precision, other batching). When they come from another implementation
(a remote engine), or when `--use-tis` asks for it, the trainer recomputes them before training
and logs `logprob_abs_diff`, the mean over response tokens of |trainer - engine|.

Which log-probs are the "old policy" of the PPO ratio (miles' flags and meanings):
- by default the trainer's recomputed ones when they were recomputed, else the engine's (the
  in-process engine's log-probs come from the trainer's own module: nothing to recompute in
  fp32, where cached decoding and the training forward agree to ~1e-6; in bf16 they differ by
  bf16's rounding, so the trainer recomputes them and the PPO ratio starts at exactly 1).
  When the rollout is a single optimizer step, the "recompute" is the training forward itself
  (`old_from_first_pass`): no forward of its own, and `logprob_abs_diff` is still logged;
- `--use-rollout-logprobs`: always the engine's;
- `--use-tis`: truncated importance sampling. Each token's policy-gradient term is multiplied
  by clamp(exp(trainer - engine), --tis-clip-low, --tis-clip), a constant weight that corrects
  for sampling from the engine's distribution rather than the trainer's. `--tis-level`,
  `--tis-mode` and `--custom-tis-function-path` choose sequence-level IS, masked/rejection IS
  (MIS, IcePop) or the user's own (`mileage.training.corrections`).
- `--get-mismatch-metrics`: recompute and log the mismatch (KL, the IS ratio) without
  correcting it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mileage.config import option
from mileage.errors import UserError
from mileage.precision import BF16, precision_of
from mileage.training.actor import Actor, sequence_logprobs
from mileage.training.batch import TrainBatch
from mileage.training.corrections import (
    MILES_ICEPOP,
    MILES_VANILLA_TIS,
    TisFunction,
    is_weights,
    mismatch_metrics,
)


@dataclass
class MismatchConfig:
    use_rollout_logprobs: bool = option(
        False, "use the engine's log-probs as the old policy even when the trainer recomputed them"
    )
    use_tis: bool = option(
        False, "truncated importance sampling: weight each token by exp(trainer - engine logprob)"
    )
    tis_clip: float = option(2.0, "upper clamp of the TIS weight")
    tis_clip_low: float = option(0.0, "lower clamp of the TIS weight")
    tis_level: str = option(
        "token",
        "--use-tis: a ratio per token, or per sequence (exp of its summed log-ratio)",
        choices=("token", "sequence"),
    )
    tis_mode: str = option(
        "truncate",
        "--use-tis: truncate (clamp the weight) or mask (MIS / IcePop: reject tokens or "
        "sequences whose ratio is outside [--tis-clip-low, --tis-clip]; they leave the loss)",
        choices=("truncate", "mask"),
    )
    custom_tis_function_path: str | None = option(
        None,
        "--use-tis: fn(config, trainer_logprobs, engine_logprobs, loss_mask) -> (weights, "
        "loss_mask, metrics); miles' vanilla_tis_function / icepop_function paths name the "
        "built-ins",
    )
    get_mismatch_metrics: bool = option(
        False, "recompute the trainer's log-probs and log the mismatch without correcting it"
    )

    def validate(self) -> None:
        if self.use_tis and self.use_rollout_logprobs:
            raise UserError(
                "--use-tis corrects the engine/trainer mismatch against the trainer's log-probs; "
                "it cannot be combined with --use-rollout-logprobs (the weights would all be 1)"
            )
        chosen = self.custom_tis_function_path or self.tis_level != "token"
        if (chosen or self.tis_mode != "truncate") and not self.use_tis:
            raise UserError(
                "--tis-level, --tis-mode and --custom-tis-function-path choose the correction of "
                "--use-tis; give --use-tis with them"
            )
        load_tis_function(self)  # a bad path stops the run here, before anything is written
        if not 0.0 <= self.tis_clip_low <= self.tis_clip:
            raise UserError(
                f"need 0 <= --tis-clip-low <= --tis-clip, got {self.tis_clip_low} and {self.tis_clip}"
            )


def needs_recompute(cfg: MismatchConfig, engine, precision: str = "fp32") -> bool:
    """Whether the trainer recomputes the sampled tokens' log-probs before training."""
    in_process = engine is not None and getattr(engine, "in_process", False)
    # in bf16 always, a replay of saved rollouts (engine None) too, so that it recomputes the
    # old log-probs exactly as the run that generated them did
    return (
        cfg.use_tis
        or cfg.get_mismatch_metrics
        or precision == BF16
        or (engine is not None and not in_process)
    )


def old_from_first_pass(cfg: MismatchConfig, actor: Actor, samples: int) -> bool:
    """Whether the trainer's old log-probs can come from its training forward itself rather
    than from a forward of their own (TRL does the same when it takes one step per generation).

    A recompute evaluates the trainer's weights now. When the rollout is one optimizer step,
    those weights are the ones the step's own forward runs with, so the values are the same
    policy's (the PPO ratio is exactly 1). Not when something needs them before that forward:
    the TIS weights and mismatch metrics, a KL penalty in the reward, or the engine's log-probs
    kept as the old policy; nor with dropout, which a recompute (in eval mode) leaves out."""
    if cfg.use_tis or cfg.get_mismatch_metrics or cfg.use_rollout_logprobs:
        return False
    algo = actor.algo
    return (
        algo.batch_sizes(samples)[0] == samples
        and not (actor.reference is not None and algo.kl_coef)
        and actor.dropout_seed is None
    )


def load_tis_function(cfg: MismatchConfig) -> TisFunction | None:
    """The user's --custom-tis-function-path (None: the built-in chosen by level and mode)."""
    path = cfg.custom_tis_function_path
    if path is None:
        return None
    if path in (MILES_VANILLA_TIS, MILES_ICEPOP):
        mode = "mask" if path == MILES_ICEPOP else "truncate"
        return lambda c, t, e, m: is_weights(
            t, e, m, level="token", mode=mode, low=c.tis_clip_low, high=c.tis_clip
        )
    from mileage.rollout.dynamic import load_function
    from mileage.rollout.userfn import Hook, named_in_thread

    fn = load_function(path, "--custom-tis-function-path")
    # what it raises (sys.exit too) is named with its flag, and its return is checked
    return named_in_thread(fn, Hook("TIS function", "--custom-tis-function-path"), tis_problem)


def tis_problem(out: object) -> str | None:
    """Why a TIS function's return is not (weights, kept mask, dict of metrics)."""
    if (
        isinstance(out, tuple)
        and len(out) == 3
        and all(isinstance(t, torch.Tensor) for t in out[:2])
        and out[0].shape == out[1].shape
        and isinstance(out[2], dict)
    ):
        if not bool(torch.isfinite(out[0]).all()):
            return "weights that are not all finite"
        return None
    return f"{type(out).__name__}; expected (weights tensor, kept-mask tensor of its shape, dict)"


@torch.no_grad()
def trainer_logprobs(
    actor: Actor, batch: TrainBatch, model: torch.nn.Module | None = None
) -> torch.Tensor:
    """The trainer's log-probs of the batch's tokens, in target space like `old_logprobs`;
    `model`: other weights of the same policy, computed the same way (`--keep-old-actor`)."""
    model = actor.model if model is None else model
    out = torch.zeros_like(batch.old_logprobs)
    was_training = model.training
    model.eval()
    for start, part in actor.algo.batching(len(batch)).parts(batch):
        logp, _ = sequence_logprobs(model, part, actor.temperature, chunk_tokens=actor.chunk_tokens)
        first = part.target_offset
        out[start : start + len(part), first : first + logp.shape[1]] = logp
    model.train(was_training)
    return out * batch.loss_mask


def apply_mismatch(
    cfg: MismatchConfig,
    engine,
    actor: Actor,
    batch: TrainBatch,
    recomputed: torch.Tensor | None = None,
) -> dict:
    """Recompute, measure and correct as configured; returns the metrics to log.
    `recomputed`: the trainer's log-probs, already computed by the caller (train-async's
    `--keep-old-actor`, with the weights that generated each row); they are then always used."""
    if recomputed is None and not needs_recompute(cfg, engine, precision_of(actor.model)):
        return {}
    if recomputed is None and old_from_first_pass(cfg, actor, len(batch)):
        batch.old_from_pass = True  # the actor logs logprob_abs_diff from that pass
        return {}
    mask = batch.loss_mask
    tokens = mask.sum().clamp(min=1.0)
    rollout = batch.old_logprobs
    trainer = trainer_logprobs(actor, batch) if recomputed is None else recomputed
    stats = {"logprob_abs_diff": float(((trainer - rollout).abs() * mask).sum() / tokens)}
    if cfg.get_mismatch_metrics:
        stats.update(mismatch_metrics(trainer, rollout, mask))
    if cfg.use_tis and (
        cfg.custom_tis_function_path or cfg.tis_level != "token" or cfg.tis_mode != "truncate"
    ):
        fn = load_tis_function(cfg) or (
            lambda c, t, e, m: is_weights(
                t, e, m, level=c.tis_level, mode=c.tis_mode, low=c.tis_clip_low, high=c.tis_clip
            )
        )
        weights, kept, metrics = fn(cfg, trainer, rollout, mask)
        batch.tis_weights, batch.loss_mask = weights * kept, kept
        stats.update({key: float(value) for key, value in metrics.items()})
    elif cfg.use_tis:
        raw = torch.exp(trainer - rollout)
        weights = raw.clamp(cfg.tis_clip_low, cfg.tis_clip)
        batch.tis_weights = weights * mask
        stats["tis_mean"] = float((weights * mask).sum() / tokens)
        stats["tis_clipfrac"] = float(((weights != raw).float() * mask).sum() / tokens)
    if not cfg.use_rollout_logprobs:
        batch.old_logprobs = trainer
    return stats
