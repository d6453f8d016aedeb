"""`AlgoConfig`: the algorithm flags, with miles' names, defaults and meaning (docs/flags.md),
and the combinations miles refuses, refused here before anything runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.userfn import Hook, load_function, loss_problem, named_in_thread
from mileage.training.losses import KL_ESTIMATORS
from mileage.training.packing import Batching

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
GROUP_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
# the default chunk of `--log-probs-chunk-size`: SmolLM2's 49,152-word logits for 341 tokens.
# Larger chunks were no faster and smaller ones slower (docs/benchmarks.md, "Memory")
LOGITS_CHUNK_BYTES = 64 << 20


@dataclass
class AlgoConfig:
    advantage_estimator: str = option("grpo", "how rewards become advantages", choices=ESTIMATORS)
    disable_grpo_std_normalization: bool = option(
        False, "GRPO: subtract the group mean only, do not divide by the group std"
    )
    normalize_advantages: bool = option(
        False, "whiten advantages over the rollout's response tokens (required by REINFORCE++)"
    )
    gamma: float = option(1.0, "discount (REINFORCE++ returns, PPO GAE)")
    lambd: float = option(1.0, "GAE lambda (PPO)")
    loss_type: str = option(
        "policy_loss",
        "policy_loss (PPO-clip), sft_loss (NLL of the sampled responses) or custom_loss",
        choices=("policy_loss", "sft_loss", "custom_loss"),
    )
    custom_loss_function_path: str | None = option(
        None,
        "with --loss-type custom_loss: module:function, module.function or file.py:function, "
        "called as fn(algo, batch, logprobs, reduce) -> (loss, {name: float})",
    )
    calculate_per_token_loss: bool = option(
        False, "token mean over the global batch (default: mean over samples of each's token mean)"
    )
    eps_clip: float = option(0.2, "PPO clip range below 1")
    eps_clip_high: float | None = option(None, "PPO clip range above 1 (default: --eps-clip)")
    eps_clip_c: float | None = option(
        None, "dual-clip PPO: bound a negative-advantage token's loss by -c*A (c > 1)"
    )
    value_clip: float = option(0.2, "PPO critic: clip of the value change around the old value")
    kl_coef: float = option(
        0.0,
        "KL-to-reference penalty in the reward (REINFORCE++ family), estimated by --kl-loss-type",
    )
    use_kl_loss: bool = option(False, "add a KL-to-reference term to the loss")
    kl_loss_coef: float = option(0.0, "weight of the KL loss")
    kl_loss_type: str = option("k1", "KL estimator (loss and reward KL)", choices=KL_ESTIMATORS)
    entropy_coef: float = option(0.0, "entropy bonus weight (entropy is always logged)")
    global_batch_size: int | None = option(
        None, "samples per optimizer step (default: the whole rollout, one step)"
    )
    micro_batch_size: int | None = option(
        None, "samples per forward/backward; gradients accumulate (default: global batch)"
    )
    use_dynamic_batch_size: bool = option(
        False,
        "cut micro-batches by tokens instead of samples: runs of samples of at most "
        "--max-tokens-per-gpu tokens, each packed into one row without padding "
        "(replaces --micro-batch-size)",
    )
    max_tokens_per_gpu: int | None = option(
        None,
        "--use-dynamic-batch-size: the tokens (prompt + response) of one packed micro-batch on "
        "one rank; a sample longer than that is refused before the run",
    )
    log_probs_chunk_size: int | None = option(
        None,
        "tokens per chunk of the LM head and log-prob computation, so a batch's vocabulary-"
        "sized logits never exist whole; -1: all at once, as miles' default (default: the "
        f"tokens whose fp32 logits fill {LOGITS_CHUNK_BYTES >> 20} MiB, stated in the plan)",
    )
    use_opsm: bool = option(
        False,
        "off-policy sequence masking: no policy-gradient term for a sequence with negative "
        "advantage whose mean log-ratio old - current exceeds --opsm-delta",
    )
    opsm_delta: float = option(1e-4, "the OPSM threshold on a sequence's mean log-ratio")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef != 0.0 or self.use_kl_loss

    @property
    def clip_high(self) -> float:
        return self.eps_clip_high if self.eps_clip_high is not None else self.eps_clip

    def validate(self, n_samples_per_prompt: int) -> None:
        """Refuse what miles refuses, and what would silently do nothing."""
        est = self.advantage_estimator
        chunk = self.log_probs_chunk_size
        if chunk is not None and chunk != -1 and chunk <= 0:
            raise UserError(
                f"--log-probs-chunk-size {chunk}: give a number of tokens > 0, or -1 for all at once"
            )
        if self.kl_coef != 0.0 and (self.use_kl_loss or self.kl_loss_coef != 0.0):
            raise UserError(
                "give --kl-coef (KL in the reward) or --use-kl-loss/--kl-loss-coef (KL in the "
                "loss), not both (miles refuses both at once)"
            )
        if self.kl_coef != 0.0 and est == "ppo":
            raise UserError(
                "--kl-coef is refused with --advantage-estimator ppo (as in miles); "
                "use --use-kl-loss --kl-loss-coef"
            )
        if self.kl_coef != 0.0 and est not in (
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
        ):
            raise UserError(
                f"--kl-coef has no effect with --advantage-estimator {est} (miles ignores it); "
                "use --use-kl-loss --kl-loss-coef"
            )
        if est.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise UserError(f"{est} needs --normalize-advantages (as in miles)")
        if est in GROUP_ESTIMATORS and n_samples_per_prompt < 2 and self.loss_type != "sft_loss":
            raise UserError(
                f"{est} needs --n-samples-per-prompt >= 2 (advantages are relative to the group)"
            )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise UserError(f"--eps-clip-c must be > 1, got {self.eps_clip_c}")
        for flag, value in (("--gamma", self.gamma), ("--lambd", self.lambd)):
            if not 0.0 <= value <= 1.0:
                raise UserError(f"{flag} must be in [0, 1], got {value}")
        if self.value_clip <= 0:
            raise UserError(f"--value-clip must be positive, got {self.value_clip}")
        if (self.loss_type == "custom_loss") != (self.custom_loss_function_path is not None):
            raise UserError("--loss-type custom_loss and --custom-loss-function-path go together")
        if self.custom_loss_function_path:
            load_custom_loss(self.custom_loss_function_path)
        self.validate_batching()

    def validate_batching(self) -> None:
        """--use-dynamic-batch-size and --max-tokens-per-gpu go together, without
        --micro-batch-size (miles ignores it then; a flag mileage would ignore is refused)."""
        budget = self.max_tokens_per_gpu
        if not self.use_dynamic_batch_size:
            if budget is not None:
                raise UserError(
                    f"--max-tokens-per-gpu {budget} applies only with --use-dynamic-batch-size "
                    "(micro-batches by tokens); give both, or neither"
                )
            return
        if budget is None:
            raise UserError(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu: the tokens of one packed "
                "micro-batch (`mileage plan` shows the memory each takes)"
            )
        if budget <= 0:
            raise UserError(f"--max-tokens-per-gpu must be positive, got {budget}")
        if self.micro_batch_size is not None:
            raise UserError(
                "--use-dynamic-batch-size cuts micro-batches by --max-tokens-per-gpu; "
                f"--micro-batch-size {self.micro_batch_size} would be ignored: give one of them"
            )

    def batching(self, samples_per_rollout: int) -> Batching:
        """How a rollout's rows become forwards: micro-batches of samples, or packed runs of at
        most --max-tokens-per-gpu tokens (`mileage.training.packing`)."""
        _, micro = self.batch_sizes(samples_per_rollout)
        return Batching(micro, self.max_tokens_per_gpu if self.use_dynamic_batch_size else None)

    def chunk_tokens(self, vocab_size: int) -> int:
        """`--log-probs-chunk-size` for a model of `vocab_size` words (-1: unchunked)."""
        if self.log_probs_chunk_size is not None:
            return self.log_probs_chunk_size
        return max(1, LOGITS_CHUNK_BYTES // (4 * max(vocab_size, 1)))

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


def load_custom_loss(path: str) -> Callable:
    """`module:function` (mileage's form, as --custom-rm-path), `module.function` (miles') or
    `path/to/file.py:function`: the one loader every user-function flag goes through."""
    fn = load_function(path, "--custom-loss-function-path")
    # what it raises (sys.exit too) is named with its flag, and its return is checked
    hook = Hook("custom loss", "--custom-loss-function-path")
    return named_in_thread(fn, hook, loss_problem)
