"""The actor: turns one rollout's samples into optimizer steps on the policy.

A rollout of N samples is cut, in order, into global batches of `--global-batch-size` samples
(one optimizer step each), and each global batch into micro-batches of `--micro-batch-size`
whose gradients accumulate. Reference log-probs are computed once per rollout, not per step.
Each micro-batch's loss is its share of the global batch's (`LossReducer`): per-sample mean by
default, token mean with `--calculate-per-token-loss`, as in miles.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from mileage import ranks
from mileage.faults import fault_point, poison_point
from mileage.precision import autocast
from mileage.seeding import derive_seed
from mileage.training.advantages import compute_advantages
from mileage.training.algo import AlgoConfig, load_custom_loss
from mileage.training.batch import TrainBatch
from mileage.training.corrections import opsm_keep
from mileage.training.critic import Critic
from mileage.training.distill import distill_advantages
from mileage.training.finite import FiniteConfig, NonFiniteError, bad_stat, check_tensors
from mileage.training.logprobs import model_logprobs, token_logprobs
from mileage.training.losses import LossReducer, kl_estimate, ppo_clip_loss
from mileage.training.optimizer import LRSchedule
from mileage.training.packing import Batching, packed_logprobs
from mileage.training.shared_prompt import forward_parameters, shared_prompt_logprobs

__all__ = ["Actor", "AlgoConfig", "sequence_logprobs"]


def sequence_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = -1,
):
    """Log-probs of `batch.targets` (and entropies), from target column `target_offset` on,
    computed in the model's precision (`mileage.precision`); the log-softmax is always fp32, and
    the LM head runs `chunk_tokens` positions at a time (`mileage.training.logprobs`). Rows
    that share a prompt share its forward (`mileage.training.shared_prompt`); a packed
    micro-batch runs as one row (`mileage.training.packing`)."""
    if batch.packed:
        return packed_logprobs(model, batch, temperature, with_entropy, entropy_grad, chunk_tokens)
    shared = shared_prompt_logprobs(
        model, batch, temperature, with_entropy, entropy_grad, chunk_tokens
    )
    if shared is not None:
        return shared
    keep = batch.input_ids.shape[1] - batch.target_offset
    with autocast(model):
        if _accepts_logits_to_keep(model):
            # the last kept position scores no target: it gets a dummy one, and is dropped
            logp, entropy = model_logprobs(
                model,
                F.pad(batch.targets, (0, 1)),
                temperature,
                with_entropy,
                entropy_grad,
                chunk_tokens,
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                logits_to_keep=keep,
            )
            return logp[:, :-1], (None if entropy is None else entropy[:, :-1])
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logits = out.logits[:, batch.target_offset : -1]
    return token_logprobs(logits, batch.targets, temperature, with_entropy, entropy_grad)


# sums over micro-batches and ranks behind the logged logprob_abs_diff (`_take_old_from_pass`)
_ABS_DIFF, _TOKENS = "_logprob_abs_diff_sum", "_logprob_tokens"


def _take_old_from_pass(part: TrainBatch, logp: torch.Tensor) -> dict[str, float]:
    """Make this forward's log-probs the old policy's (`TrainBatch.old_from_pass`), as a
    recompute would have given them; returns the sums behind the engine/trainer mismatch."""
    engine = part.old_logprobs
    part.old_logprobs = logp.detach() * part.loss_mask
    diff = ((part.old_logprobs - engine).abs() * part.loss_mask).sum()
    return {_ABS_DIFF: float(diff), _TOKENS: float(part.loss_mask.sum())}


def _count_embedded_tokens(model: torch.nn.Module) -> list[int]:
    """A one-element counter of the tokens `model` embeds under autograd (a forward pre-hook on
    its input embedding: every token a training forward runs passes through it once). The hook
    is a plain closure, so deep copies of the model share the counter instead of copying it;
    they generate without autograd, which it does not count."""
    counter = [0]
    get_embedding = getattr(model, "get_input_embeddings", None)
    embedding = get_embedding() if get_embedding is not None else None
    if embedding is None:
        return counter

    def count(module: torch.nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled() and args:
            counter[0] += args[0].numel()

    embedding.register_forward_pre_hook(count)
    return counter


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in forward_parameters(model)


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
        critic: Critic | None = None,
        dropout_seed: int | None = None,
        finite: FiniteConfig | None = None,
        teacher: torch.nn.Module | None = None,
        opd_kl_coef: float = 0.0,
    ):
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.algo = algo
        self.temperature = temperature
        self.group_size = group_size
        self.clip_grad = clip_grad
        self.reference = reference
        self.critic = critic
        # --use-opd: the frozen teacher whose log-probs enter the advantage (training/distill.py)
        self.teacher = teacher
        self.opd_kl_coef = opd_kl_coef
        self.opd_reverse_kl: float | None = None  # the last prepared rollout's
        # set when training uses dropout (LoRA): each optimizer step draws its dropout masks
        # from a generator seeded by (seed, step), so a resumed run drops the same units
        self.dropout_seed = dropout_seed
        self.finite = finite or FiniteConfig()
        self.step = 0
        self.nonfinite_skipped = 0  # optimizer steps skipped for a NaN/inf loss or gradient
        self._custom_loss = None
        vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
        self.chunk_tokens = algo.chunk_tokens(vocab)  # --log-probs-chunk-size
        # tokens of the rollout's largest training forward (what its activations scale with;
        # shared prompts run once), for the memory estimate logged beside the measured peak
        self.largest_pass_tokens = self.largest_pass_logits = 0
        self._embedded = _count_embedded_tokens(model)

    @torch.no_grad()
    def _frozen_logprobs(self, model, batch: TrainBatch, batching: Batching) -> torch.Tensor:
        """Log-probs of `batch`'s tokens under a frozen model (the reference or the teacher),
        in target space; zero outside the response."""
        out = torch.zeros_like(batch.old_logprobs)
        for start, part in batching.parts(batch):
            logp, _ = sequence_logprobs(
                model, part, self.temperature, chunk_tokens=self.chunk_tokens
            )
            first = part.target_offset
            out[start : start + len(part), first : first + logp.shape[1]] = logp
        return out

    def prepare(self, batch: TrainBatch, batching: Batching) -> None:
        """Attach reference log-probs (if any) and advantages, with the teacher's term under
        --use-opd."""
        algo = self.algo
        check_tensors("a reward", [("rewards", batch.rewards)])
        token_kl = None
        if self.reference is not None:
            batch.ref_logprobs = self._frozen_logprobs(self.reference, batch, batching)
            if algo.kl_coef:
                token_kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, algo.kl_loss_type)
        if self.critic is not None:
            batch.values = self.critic.values(batch, batching)
        if algo.loss_type == "sft_loss":  # an NLL: no advantage enters it (miles'
            # --disable-compute-advantages-and-returns), and one answer per record has no group
            batch.advantages = torch.zeros_like(batch.old_logprobs)
            return
        batch.advantages, batch.returns = compute_advantages(
            algo.advantage_estimator,
            batch.rewards,
            batch.loss_mask,
            self.group_size,
            token_kl,
            algo.kl_coef,
            normalize_std=not algo.disable_grpo_std_normalization,
            gamma=algo.gamma,
            lambd=algo.lambd,
            values=batch.values,
            normalize=algo.normalize_advantages,
        )
        teacher = batch.teacher_logprobs  # a served teacher's, scored with the rollout
        if self.teacher is not None:
            teacher = self._frozen_logprobs(self.teacher, batch, batching)
        if teacher is not None:
            batch.advantages, self.opd_reverse_kl = distill_advantages(
                batch.advantages, batch.old_logprobs, teacher, batch.loss_mask, self.opd_kl_coef
            )
        # finite rewards can still overflow here (e.g. 1e308 in a group's mean)
        check_tensors("an advantage", [("advantages", batch.advantages)])

    def release_gradients(self) -> None:
        """Free the actor's and the critic's gradients once a rollout's optimizer steps are done:
        the next step starts from None anyway, and generation (under torchrun, with the gathered
        full parameters) then runs without them."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.optimizer.zero_grad(set_to_none=True)

    def train_rollout(self, batch: TrainBatch) -> dict[str, float]:
        """All optimizer steps for one rollout; returns statistics averaged over its steps."""
        gbs, _ = self.algo.batch_sizes(len(batch))
        batching = self.algo.batching(len(batch))
        self.largest_pass_tokens = self.largest_pass_logits = 0
        self.prepare(batch, batching)
        critic_stats = {}
        if self.critic is not None:
            frozen = self.critic.actor_frozen
            critic_stats = self.critic.train_rollout(batch, gbs, batching)
            if frozen:
                lr = self.schedule.lr_at(self.step)
                return {**critic_stats, "lr": lr, "lrs": [], "global_step": self.step}
        self.model.train()
        totals: dict[str, float] = {}
        grad_norms, lrs = [], []
        per_token = self.algo.calculate_per_token_loss
        skipped_before = self.nonfinite_skipped
        for g_start in range(0, len(batch), gbs):
            mask = batch.loss_mask[g_start : g_start + gbs]
            denominator = LossReducer.global_denominator(mask, per_token)
            self.optimizer.zero_grad(set_to_none=True)
            step_stats: dict[str, float] = {}
            with self._step_rng():
                for part in batching.rank_parts(batch, g_start, gbs):  # this rank's share
                    reduce = LossReducer(part.loss_mask, per_token, denominator)
                    stats = self._accumulate(part, reduce)
                    for key, value in stats.items():
                        step_stats[key] = step_stats.get(key, 0.0) + value
            for key, value in step_stats.items():
                totals[key] = totals.get(key, 0.0) + value
            poison_point("nan_gradient", [p.grad for p in self.model.parameters()])
            if self.clip_grad > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            else:
                norm = torch.nn.utils.get_total_norm(
                    [p.grad for p in self.model.parameters() if p.grad is not None]
                )
            lr = self.schedule.lr_at(self.step)
            if self._applies(norm, step_stats):
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
                grad_norms.append(float(norm))
            self.step += 1
            fault_point("optimizer_step")
            lrs.append(lr)
        poison_point("nan_weight", [p for p in self.model.parameters() if p.requires_grad])
        # a finite gradient with a finite LR keeps AdamW's weights finite, but nothing else here
        # would notice if it did not: one pass over the trained weights per rollout
        check_tensors(
            f"the weights after optimizer step {self.step}",
            ((n, p) for n, p in self.model.named_parameters() if p.requires_grad),
        )
        self.model.eval()
        totals = ranks.sum_over_ranks(totals)
        abs_diff, tokens = totals.pop(_ABS_DIFF, None), totals.pop(_TOKENS, None)
        result = {key: value / len(lrs) for key, value in totals.items()}
        if abs_diff is not None:  # the same token mean as a recompute logs
            result["logprob_abs_diff"] = abs_diff / max(tokens, 1.0)
        result.update(critic_stats)
        if grad_norms:  # the norms of the steps applied
            result["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if self.nonfinite_skipped:
            result["nonfinite_skipped"] = self.nonfinite_skipped - skipped_before
        result.update(lr=lrs[-1], lrs=lrs, global_step=self.step)
        if self.opd_reverse_kl is not None:
            result["opd_reverse_kl"] = self.opd_reverse_kl
        return result

    def _applies(self, norm: torch.Tensor, step_stats: dict[str, float]) -> bool:
        """Whether this optimizer step's loss and gradient are finite on every rank; if not,
        stop with `NonFiniteError`, or (--no-check-for-nan-in-loss-and-grad) skip the step."""
        loss = bad_stat(step_stats)
        loss_anywhere = ranks.any_rank(loss is not None)
        if not loss_anywhere and math.isfinite(float(norm)):
            return True
        quantity, detail = (
            ("the loss", loss or "a loss term on another rank")
            if loss_anywhere
            else ("the gradient", f"global norm {float(norm)}")
        )
        detail += f" at optimizer step {self.step}"
        if self.finite.check_for_nan_in_loss_and_grad:
            raise NonFiniteError(
                quantity, detail + " (--no-check-for-nan-in-loss-and-grad skips such steps)"
            )
        self.nonfinite_skipped += 1
        if self.nonfinite_skipped > self.finite.max_nonfinite_skips:
            raise NonFiniteError(
                quantity,
                f"{detail}; {self.nonfinite_skipped} steps skipped in this run, more than "
                f"--max-nonfinite-skips {self.finite.max_nonfinite_skips}",
            )
        self.optimizer.zero_grad(set_to_none=True)
        return False

    @contextmanager
    def _step_rng(self) -> Iterator[None]:
        """Without dropout: nothing. With it: the global RNG of the policy's device, forked and
        seeded for this optimizer step (the masks depend on (seed, step) alone)."""
        if self.dropout_seed is None:
            yield
            return
        device = next(self.model.parameters()).device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(self.dropout_seed, "dropout", self.step))
            yield

    def _main_loss(self, part: TrainBatch, logp: torch.Tensor, reduce: LossReducer):
        algo = self.algo
        if algo.loss_type == "sft_loss":
            loss = -reduce(logp)
            return loss, {"sft_loss": float(loss.detach())}
        if algo.loss_type == "custom_loss":
            if self._custom_loss is None:
                self._custom_loss = load_custom_loss(algo.custom_loss_function_path)
            loss, metrics = self._custom_loss(algo, part, logp, reduce)
            return loss, {key: float(value) for key, value in metrics.items()}
        weights = part.tis_weights
        opsm = None
        if algo.use_opsm:
            opsm = opsm_keep(
                logp, part.old_logprobs, part.advantages, part.loss_mask, algo.opsm_delta
            )
            weights = opsm * (weights if weights is not None else part.loss_mask)
        per_token, clip = ppo_clip_loss(
            logp,
            part.old_logprobs,
            part.advantages,
            part.loss_mask,
            algo.eps_clip,
            algo.clip_high,
            algo.eps_clip_c,
            sequence_level=algo.advantage_estimator == "gspo",
            token_weights=weights,
        )
        loss = reduce(per_token)
        stats = {"pg_loss": float(loss.detach())}
        if opsm is not None:
            stats["opsm_masked_frac"] = float(reduce((1.0 - opsm).expand_as(part.loss_mask)))
        stats.update({key: float(reduce(value)) for key, value in clip.items()})
        return loss, stats

    def _accumulate(self, part: TrainBatch, reduce: LossReducer) -> dict[str, float]:
        self._embedded[0] = 0
        logp, entropy = sequence_logprobs(
            self.model,
            part,
            self.temperature,
            with_entropy=True,
            entropy_grad=self.algo.entropy_coef != 0.0,
            chunk_tokens=self.chunk_tokens,
        )
        self.largest_pass_tokens = max(self.largest_pass_tokens, self._embedded[0])
        self.largest_pass_logits = max(self.largest_pass_logits, part.loss_mask.numel())
        taken = _take_old_from_pass(part, logp) if part.old_from_pass else {}
        loss, stats = self._main_loss(part, logp, reduce)
        stats.update(taken)
        entropy_loss = reduce(entropy)
        if self.algo.entropy_coef:
            loss = loss - self.algo.entropy_coef * entropy_loss
        stats["entropy"] = float(entropy_loss.detach())
        # the drift from the old policy of the PPO ratio (the one that generated the samples),
        # k1 of old vs current: verl's and miles' `ppo_kl`. It is ~0 at a rollout's first
        # optimizer step by construction, so it is never reported as a KL to anything else.
        if self.algo.loss_type != "sft_loss":  # SFT has no policy that sampled its answers
            stats["ppo_kl"] = float(reduce(part.old_logprobs - logp.detach()))
        if part.ref_logprobs is not None:
            # `kl` is only ever the KL to the reference model, never a stand-in for it
            kl = reduce(kl_estimate(logp, part.ref_logprobs, self.algo.kl_loss_type))
            if self.algo.use_kl_loss and self.algo.kl_loss_coef:
                loss = loss + self.algo.kl_loss_coef * kl
            stats["kl"] = float(kl.detach())
        loss.backward()
        return stats

    def state_dict(self) -> dict:
        state = {"step": self.step}
        if self.nonfinite_skipped:  # only then: other runs keep byte-identical trainer states
            state["nonfinite_skipped"] = self.nonfinite_skipped
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
