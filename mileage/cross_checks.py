"""The checks across a run's parts, in one place: each part's own flags are checked by its
config's `validate` (called from here); what depends on two parts or more is checked here, before
anything loads or is written. Every refusal is one line that names what would work (exit 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mileage.config import flag_of
from mileage.distributed import env
from mileage.errors import UserError
from mileage.rollout.sizes import check_thread_count
from mileage.training.optimizer import OptimConfig

if TYPE_CHECKING:
    from mileage.run_config import RunConfig

# counts and lengths that must be > 0, and values that must be >= 0, by (section, field);
# a value of None means "not given" and is left to its default
POSITIVE = (
    ("rollout", "rollout_batch_size"),
    ("rollout", "n_samples_per_prompt"),
    ("rollout", "rollout_max_response_len"),
    ("loop", "num_threads"),
    ("loop", "num_rollout"),
    ("loop", "num_epoch"),
    ("loop", "debug_exit_after_rollout"),
    ("eval", "n_samples_per_eval_prompt"),
    ("eval", "eval_max_response_len"),
    ("checkpoint", "save_interval"),
    ("checkpoint", "save_keep_last"),
    ("algo", "global_batch_size"),
    ("algo", "micro_batch_size"),
    ("optim", "lr_decay_iters"),
)
NON_NEGATIVE = (
    ("loop", "stop_grace_seconds"),
    ("finite", "max_nonfinite_skips"),
    ("loop", "eval_interval"),
    ("checkpoint", "start_rollout_id"),
    ("checkpoint", "ckpt_step"),
    ("checkpoint", "ref_ckpt_step"),
    ("rollout", "rollout_temperature"),
    ("eval", "eval_temperature"),
    ("optim", "lr"),
    ("optim", "min_lr"),
    ("optim", "lr_warmup_iters"),
    ("optim", "weight_decay"),
    ("optim", "adam_eps"),
    ("optim", "clip_grad"),
    ("engine", "vllm_restarts"),
)


def check_run(cfg: RunConfig) -> None:
    """What every command that trains refuses (one line each, exit 2)."""
    r = cfg.rollout
    for fields, positive in ((POSITIVE, True), (NON_NEGATIVE, False)):
        for section, name in fields:
            value = getattr(getattr(cfg, section), name)
            if value is not None and (value <= 0 if positive else value < 0):
                flag = flag_of(type(getattr(cfg, section)), name)
                raise UserError(f"{flag} must be {'positive' if positive else '>= 0'}, got {value}")
    check_thread_count(cfg.loop.num_threads)
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(cfg.optim, name)
        if not 0.0 <= value < 1.0:
            raise UserError(f"{flag_of(OptimConfig, name)} must be in [0, 1), got {value}")
    if cfg.loop.num_rollout is not None and cfg.loop.num_epoch is not None:
        raise UserError("give --num-rollout or --num-epoch, not both")
    for flag, top_p in (
        ("--rollout-top-p", r.rollout_top_p),
        ("--eval-top-p", cfg.eval.eval_top_p),
    ):
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise UserError(f"{flag} must be in (0, 1], got {top_p}")
    cfg.algo.validate(r.n_samples_per_prompt)
    cfg.checkpoint.validate()
    cfg.critic.validate(cfg.algo.advantage_estimator)
    cfg.opd.validate()
    cfg.reward.validate()
    cfg.parallel.validate(env.world_size(), *cfg.algo.batch_sizes(r.samples_per_rollout))
    cfg.engine.validate()
    cfg.multiturn.validate()
    cfg.hooks.validate()
    if cfg.multiturn.rollout_function_path and cfg.dynamic.dynamic_sampling_filter_path:
        raise UserError(
            "--rollout-function-path replaces the rollout that dynamic sampling draws; give "
            "it or --dynamic-sampling-filter-path"
        )
    if (
        env.world_size() > 1
        and (cfg.multiturn.multi_turn or cfg.multiturn.rollout_function_path)
        and cfg.engine.on_every_rank
    ):
        # rank 0 runs such rollouts against the servers and shares the samples
        # (`distributed.remote.where_driven`); an engine on every rank has no rank 0 to
        # drive it: every rank generates its share at once
        which = (
            "colocated vLLM runs in every rank's process (vLLM joins the trainer's process group)"
            if cfg.engine.colocate
            else "the in-process engine decodes with the policy's shards on every rank"
        )
        raise UserError(
            "multi-turn rollouts (--custom-generate-function-path, --rollout-function-path, "
            "tools) under torchrun generate on remote engines (--rollout-engine sglang or "
            f"vllm with --rollout-url, e.g. `mileage serve`): {which} at once, so each rank "
            "would run the tools"
        )
    cfg.mismatch.validate()
    cfg.lora.validate()
    if (
        cfg.lora.enabled
        and env.world_size() > 1
        and cfg.engine.remote
        and cfg.engine.rollout_weight_sync == "broadcast"
    ):
        raise UserError(
            "--lora-rank under torchrun syncs the remote engines through the disk (the base "
            "once, then the adapter); drop --rollout-weight-sync broadcast"
        )
    if cfg.lora.lora_sync_from_tensor and cfg.engine.rollout_engine != "sglang":
        raise UserError(
            "--lora-sync-from-tensor sends the adapter to `mileage serve` servers "
            f"(--rollout-engine sglang); --rollout-engine {cfg.engine.rollout_engine} "
            "does not take it"
        )
    cfg.dynamic.validate()
    mt = cfg.multiturn
    user_generation = [
        flag
        for flag, value in (
            ("--custom-generate-function-path", mt.custom_generate_function_path),
            ("--agent-function-path", mt.agent_function_path),
            ("--rollout-function-path", mt.rollout_function_path),
        )
        if value
    ]
    if cfg.dynamic.partial_rollout and user_generation:
        raise UserError(
            f"--partial-rollout stops trajectories at a token budget and continues them "
            f"after a checkpoint, perhaps in another process; with {user_generation[0]} a "
            "trajectory's progress lives in your function's own frames, which no checkpoint "
            "can hold (the built-in tool loop, --generate-execute-tool-function-path, is "
            "continued across rounds)"
        )
    if cfg.dynamic.partial_rollout and r.load_debug_rollout_data:
        raise UserError(
            "--partial-rollout generates across rounds and rollouts; it cannot replay "
            "--load-debug-rollout-data (replay a run without --partial-rollout)"
        )
    cfg.shaping.validate(r.rollout_max_response_len)
    cfg.precision.requested()


def check_async(cfg: RunConfig) -> None:
    """What `mileage train-async` refuses beyond `check_run` (one line each, exit 2)."""
    rc = cfg.rollout
    if env.world_size() > 1 and not cfg.engine.remote:
        raise UserError(
            "train-async under torchrun generates on remote engines only (--rollout-engine "
            "sglang with --rollout-url, e.g. `mileage serve`); run it as one process for the "
            "in-process engine, or train synchronously under torchrun with "
            "`torchrun ... -m mileage train ...`"
        )
    if rc.load_debug_rollout_data:
        raise UserError(
            "--load-debug-rollout-data replays saved rollouts and has no engine to generate "
            "ahead with; replay with `mileage train`"
        )
    if cfg.engine.colocate:
        raise UserError(
            "--colocate runs vLLM in this process, and vLLM seeds and draws from the "
            "process-wide random generators the trainer draws from; train-async generates "
            "in a background thread while training runs, so their draws would interleave in "
            "an order no checkpoint can replay: drop --colocate (train-async launches a vLLM "
            "server), or colocate with `mileage train`"
        )
    dynamic = cfg.dynamic
    if dynamic.partial_rollout and cfg.asynchronous.keep_old_actor:
        raise UserError(
            "--partial-rollout continues answers across slots, so one answer's tokens come "
            "from several weight versions, and --keep-old-actor recomputes a row with the "
            "one version that generated it: drop --keep-old-actor (--off-policy-correction "
            "corrects each token for the weights that wrote it)"
        )
    if dynamic.mask_offpolicy_in_partial_rollout:
        raise UserError(
            "--mask-offpolicy-in-partial-rollout trains only the tokens of the trainer's "
            "current weights; train-async trains tokens of older weights by design (one "
            "step off, or up to --max-weight-staleness) and corrects each for the weights "
            "that wrote it (--off-policy-correction): drop the mask, or mask with "
            "`mileage train`"
        )
    if dynamic.over_sampling_batch_size is not None:
        raise UserError(
            "--over-sampling-batch-size sizes the sampling rounds of `mileage train`; "
            "train-async generates whole slots of --rollout-batch-size prompts ahead and "
            "makes up the groups its --dynamic-sampling-filter-path drops with further slots"
        )
    if dynamic.buffer_filter_path:
        raise UserError(
            "--buffer-filter-path picks from dynamic sampling's leftover groups; train-async "
            "trains its buffered groups in submission order, which its --max-weight-staleness "
            "admission is defined by"
        )
    acfg = cfg.asynchronous
    acfg.validate(rc.rollout_batch_size, rc.samples_per_rollout)
    mc = cfg.mismatch
    if acfg.keep_old_actor and mc.use_rollout_logprobs:
        raise UserError(
            "--use-rollout-logprobs takes the engine's log-probs as the PPO ratio's denominator, "
            "which --keep-old-actor recomputes with the weights that generated them; choose one"
        )
    corrects = acfg.corrects(rc.rollout_batch_size) and not acfg.keep_old_actor
    if corrects and (mc.use_tis or mc.use_rollout_logprobs):
        raise UserError(
            "--use-tis / --use-rollout-logprobs choose the old policy of synchronous "
            "training; with samples from older weights, --off-policy-correction does "
            "(decoupled or tis), or --keep-old-actor with them"
        )
