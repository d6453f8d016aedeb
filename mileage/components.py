"""Builds the parts of a run from its config and plan, restores them, and captures their state.

Everything here is plumbing; the algorithm itself reads top to bottom in `loop.py`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from mileage.checkpoint.layout import META, DirState
from mileage.checkpoint.meta import (
    checkpoint_meta,
    model_source,
    recorded_model_dir,
    recorded_source,
    selected_checkpoint,
)
from mileage.checkpoint.plan import (
    RESUME,
    ResumePlan,
    StartFlags,
    gather_disk_state,
    plan_start,
    reference_source,
)
from mileage.checkpoint.store import (
    TRAINER_STATE,
    CheckpointState,
    CheckpointWriteError,
    read_json,
    verify_checkpoint,
)
from mileage.checkpoint.tensors import (
    load_model_weights,
    load_optimizer_tensors,
    load_rng_tensors,
    optimizer_tensors,
)
from mileage.checkpoint.writer import CheckpointWriter
from mileage.distributed import env
from mileage.distributed.checkpoint import ShardedCheckpointWriter, rng_of_this_rank
from mileage.distributed.parallelize import shard_run_models
from mileage.distributed.rollout import ShardedGenerationEngine
from mileage.errors import UserError
from mileage.metrics import MetricsLog
from mileage.models.hf import (
    check_weight_files,
    empty_causal_lm,
    load_causal_lm,
    load_tokenizer,
    read_config_json,
    require_chat_template,
)
from mileage.models.tensors import model_tensors
from mileage.models.tiny import (
    build_char_tokenizer,
    builtin_model_dir,
    ensure_builtin_model,
    tiny_llama_config,
)
from mileage.precision import resolve, set_precision
from mileage.rollout.data import (
    Prompt,
    PromptSource,
    load_eval_prompts,
    load_train_prompts,
    task_reward,
)
from mileage.rollout.engine import SamplingParams
from mileage.rollout.engines.base import Engine
from mileage.rollout.engines.factory import build_engine
from mileage.rollout.rewards import RewardFn, build_reward_fn
from mileage.rollout.rollout import PromptEncoder
from mileage.rollout.sizes import check_rollout_sizes
from mileage.rollout.tasks import builtin_alphabet
from mileage.run_config import RunConfig
from mileage.seeding import capture_rng_state, configure_determinism, restore_rng_state
from mileage.tracking import build_trackers, check_tracking, new_wandb_run_id
from mileage.training.actor import Actor
from mileage.training.critic import build_critic, critic_checkpoint_state, restore_critic
from mileage.training.optimizer import build_optimizer, build_schedule


def hf_checkpoint_path(cfg: RunConfig) -> str:
    """--hf-checkpoint, or the built-in model's cache directory (which may not be built yet)."""
    return cfg.checkpoint.hf_checkpoint or str(builtin_model_dir(cfg.data.builtin_task))


def with_recorded_model(cfg: RunConfig, log) -> RunConfig:
    """Raw mode without --hf-checkpoint: the model the --ref-load checkpoint records it came from."""
    ck = cfg.checkpoint
    if ck.megatron_to_hf_mode != "raw" or ck.hf_checkpoint or not ck.ref_load:
        return cfg
    try:
        checkpoint = selected_checkpoint(ck.ref_load, ck.ref_ckpt_step, "--ref-ckpt-step")
    except UserError:
        return cfg  # plan_start names what is wrong with --ref-load
    if not (checkpoint / META).is_file():
        return cfg  # an incomplete checkpoint: plan_start refuses it
    source = recorded_source(checkpoint)
    if source and source.get("builtin_task"):
        log(f"raw mode: architecture and tokenizer of the built-in model (as {checkpoint} records)")
        return cfg
    path = recorded_model_dir(checkpoint, log)
    return replace(cfg, checkpoint=replace(ck, hf_checkpoint=path))


def model_config_of(cfg: RunConfig) -> dict:
    if cfg.checkpoint.hf_checkpoint:
        return read_config_json(cfg.checkpoint.hf_checkpoint)
    tok = build_char_tokenizer(builtin_alphabet())
    return tiny_llama_config(
        len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    ).to_dict()


@dataclass
class Preflight:
    """Everything that can fail on user input, loaded before anything is written."""

    plan: ResumePlan
    flags: StartFlags
    prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    reward_fn: RewardFn


def require_directories(**paths: str | None) -> None:
    """Each given path is absent or a directory (a file there is a mistyped flag, not a start)."""
    for flag, path in paths.items():
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"--{flag.replace('_', '-')} {path} is a file, not a directory")


def preflight(cfg: RunConfig) -> Preflight:
    """The plan and its inputs; cheap (reads JSON and directory listings, no tensors)."""
    ck = cfg.checkpoint
    require_directories(save=ck.save, load=ck.load, ref_load=ck.ref_load)
    prompts = load_train_prompts(cfg.data)
    eval_prompts = load_eval_prompts(cfg.data)
    reward_fn = build_reward_fn(cfg.reward, task_reward(cfg.data))
    check_tracking(cfg.tracking)
    model_config = model_config_of(cfg)
    if cfg.checkpoint.hf_checkpoint:
        # a broken tokenizer or weight file stops the run here, before anything is written
        tokenizer = load_tokenizer(cfg.checkpoint.hf_checkpoint)
        check_weight_files(cfg.checkpoint.hf_checkpoint)
    else:
        tokenizer = build_char_tokenizer(builtin_alphabet())
    if cfg.data.apply_chat_template:
        require_chat_template(tokenizer, hf_checkpoint_path(cfg))
    rc = cfg.rollout
    local = cfg.engine.rollout_engine == "local" and not rc.load_debug_rollout_data
    check_rollout_sizes(
        model_config,
        PromptEncoder(tokenizer, cfg.data.apply_chat_template),
        [p.text for p in prompts],
        [p.text for p in eval_prompts or []] if cfg.loop.eval_interval else [],
        rc.rollout_batch_size,
        rc.n_samples_per_prompt,
        rc.rollout_max_response_len,
        env.device() if local else None,
    )
    flags = cfg.checkpoint.start_flags(hf_checkpoint_path(cfg), cfg.num_rollout(len(prompts)))
    ppo = cfg.algo.advantage_estimator == "ppo"
    precision, precision_note = resolve(cfg.precision.requested(), env.device())
    flags = replace(
        flags,
        world_size=env.world_size(),
        critic=ppo,
        critic_load=cfg.critic.critic_load,
        precision=precision,
        precision_note=precision_note,
    )
    disk = gather_disk_state(flags, model_config)
    if not cfg.checkpoint.hf_checkpoint and not disk.hf_checkpoint.exists:
        # the built-in model is built on first use; plan as if it were there
        built = DirState(flags.hf_checkpoint, True, hf_config=model_config, hf_weights=True)
        disk = replace(disk, hf_checkpoint=built)
    return Preflight(plan_start(flags, disk), flags, prompts, eval_prompts, reward_fn)


@dataclass
class Run:
    cfg: RunConfig
    plan: ResumePlan
    tokenizer: object
    encode: PromptEncoder
    actor: Actor
    engine: Engine | None  # None when replaying saved rollout data
    data: PromptSource
    eval_prompts: list[Prompt] | None
    reward_fn: RewardFn
    sampling: SamplingParams
    writer: CheckpointWriter | None
    metrics: MetricsLog
    model_config: dict
    model_source: dict  # what meta.json records the run was trained from
    wandb_run_id: str | None  # kept in the trainer state, so a resumed run continues the W&B run

    @property
    def model(self) -> torch.nn.Module:
        return self.actor.model

    @property
    def device(self) -> torch.device:
        """Where the policy trains: the rank's GPU under NCCL, else the CPU."""
        return next(self.model.parameters()).device


def _load_weights(path: str, fmt: str, config_dir: str) -> torch.nn.Module:
    if fmt == "hf":
        return load_causal_lm(path)
    problems = verify_checkpoint(path)
    if problems:
        raise UserError(
            f"checkpoint {path} is corrupt: {problems[0]}; choose another with --ckpt-step"
        )
    model = empty_causal_lm(config_dir)
    load_model_weights(path, model)
    return model


def _hf_exporter(template: str | None, config_dir: str, log):
    """`--save-hf`: after each commit, export the committed weights as an HF directory."""
    if not template:
        return None
    from mileage.checkpoint.hf_export import export_hf

    def export(rollout_id: int, checkpoint) -> None:
        out = template.format(rollout_id=rollout_id)
        try:
            export_hf(checkpoint, config_dir, out)
        except OSError as exc:
            raise CheckpointWriteError(f"--save-hf: writing {out} failed: {exc}") from None
        log(f"exported HF weights of rollout {rollout_id} to {out}")

    return export


def build_run(cfg: RunConfig, pre: Preflight, log) -> Run:
    plan, flags = pre.plan, pre.flags
    configure_determinism(cfg.loop.seed, cfg.loop.num_threads)
    if not cfg.checkpoint.hf_checkpoint:
        ensure_builtin_model(cfg.data.builtin_task, log=log)
    config_dir = flags.hf_checkpoint
    tokenizer = load_tokenizer(config_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # every copy made from here on (critic body, generation copy) inherits the precision
    model = set_precision(
        _load_weights(plan.weights_from, plan.weights_format, config_dir), plan.precision
    )
    reference = None
    if cfg.algo.needs_reference:
        ref_path, ref_fmt = reference_source(flags, gather_disk_state(flags, None))
        reference = _load_weights(ref_path, ref_fmt, config_dir).requires_grad_(False)
        set_precision(reference, plan.precision)
        log(f"reference model: {ref_path} ({ref_fmt})")
    eos = tokenizer.eos_token_id
    engine = None
    if not cfg.rollout.load_debug_rollout_data:
        engine = build_engine(cfg.engine, model, tokenizer.pad_token_id, eos, config_dir, log)
    if env.is_distributed():  # FSDP2; the engine decodes with a full copy (see distributed/)
        model, reference, generation_copy = shard_run_models(model, reference, cfg.parallel)
        if engine is not None:
            engine.model = generation_copy
            engine = ShardedGenerationEngine(engine, cfg.rollout.n_samples_per_prompt)
    optimizer = build_optimizer(model, cfg.optim)
    steps_per_rollout = (
        cfg.rollout.samples_per_rollout // cfg.algo.batch_sizes(cfg.rollout.samples_per_rollout)[0]
    )
    schedule = build_schedule(cfg.optim, plan.num_rollout * steps_per_rollout)
    critic = None
    if plan.critic:
        critic = build_critic(
            cfg.critic,
            cfg.optim,
            cfg.algo,
            model,
            plan.critic_from,
            config_dir,
            cfg.loop.seed,
            plan.num_rollout * steps_per_rollout,
            cfg.optim.clip_grad,
        )
        log(f"critic: {plan.critic_from or 'the actor weights'} + value head")
    actor = Actor(
        model,
        optimizer,
        schedule,
        cfg.algo,
        temperature=cfg.rollout.rollout_temperature or 1.0,
        group_size=cfg.rollout.n_samples_per_prompt,
        clip_grad=cfg.optim.clip_grad,
        reference=reference,
        critic=critic,
    )
    resumed = read_json(plan.weights_from, TRAINER_STATE) if plan.action == RESUME else {}
    wandb_run_id = resumed.get("tracking", {}).get("wandb_run_id")
    if wandb_run_id is None and cfg.tracking.use_wandb:
        wandb_run_id = new_wandb_run_id()
    metrics_dir = cfg.checkpoint.save if env.is_main() else None  # rank 0 logs for all
    writer = None
    if cfg.checkpoint.save:
        writer = (ShardedCheckpointWriter if env.is_distributed() else CheckpointWriter)(
            cfg.checkpoint.save,
            cfg.checkpoint.save_keep_last,
            cfg.checkpoint.async_save,
            on_commit=_hf_exporter(cfg.checkpoint.save_hf, config_dir, log),
        )
    return Run(
        cfg=cfg,
        plan=plan,
        tokenizer=tokenizer,
        encode=PromptEncoder(tokenizer, cfg.data.apply_chat_template),
        actor=actor,
        engine=engine,
        data=PromptSource(pre.prompts, cfg.data.rollout_shuffle, cfg.loop.seed),
        eval_prompts=pre.eval_prompts,
        reward_fn=pre.reward_fn,
        sampling=SamplingParams(
            cfg.rollout.rollout_max_response_len,
            cfg.rollout.rollout_temperature,
            cfg.rollout.rollout_top_p,
        ),
        writer=writer,
        metrics=MetricsLog(
            metrics_dir,
            build_trackers(cfg.tracking, metrics_dir, wandb_run_id, asdict(cfg)),
        ),
        model_config=read_config_json(config_dir),
        model_source=model_source(
            config_dir, None if cfg.checkpoint.hf_checkpoint else cfg.data.builtin_task
        ),
        wandb_run_id=wandb_run_id,
    )


def restore(run: Run, log) -> None:
    """Load what the plan says beyond the weights (already loaded by build_run)."""
    plan = run.plan
    run.metrics.truncate_from(plan.start_rollout_id)
    if plan.action != RESUME:
        return
    trainer = read_json(plan.weights_from, TRAINER_STATE)
    run.actor.load_state_dict(trainer["actor"])
    if plan.critic_state:
        restore_critic(run.actor.critic, plan.weights_from, trainer["critic"], plan.load_optimizer)
    if plan.load_optimizer:
        load_optimizer_tensors(plan.weights_from, run.model, run.actor.optimizer)
    if plan.load_rng:
        restore_rng_state(rng_of_this_rank(load_rng_tensors(plan.weights_from)), trainer["rng"])
    if plan.load_data_state:
        run.data.load_state_dict(trainer["data"])
    log(f"restored {plan.weights_from}: optimizer step {run.actor.step}, data {trainer['data']}")


def checkpoint_state(run: Run, rollout_id: int) -> CheckpointState:
    rng_tensors, rng_plain = capture_rng_state()
    trainer = {"actor": run.actor.state_dict(), "data": run.data.state_dict(), "rng": rng_plain}
    if run.wandb_run_id:  # only then: runs without W&B keep byte-identical trainer states
        trainer["tracking"] = {"wandb_run_id": run.wandb_run_id}
    critic = None
    if run.actor.critic is not None:
        trainer["critic"] = run.actor.critic.state_dict()
        critic = critic_checkpoint_state(
            run.actor.critic,
            checkpoint_meta(
                run.model_config,
                rollout_id,
                source=run.model_source,
                global_step=run.actor.critic.step,
                precision=run.plan.precision,
            ),
        )
    return CheckpointState(
        model=model_tensors(run.model),
        optimizer=optimizer_tensors(run.model, run.actor.optimizer),
        rng=rng_tensors,
        trainer=trainer,
        meta=checkpoint_meta(
            run.model_config,
            rollout_id=rollout_id,
            source=run.model_source,
            global_step=run.actor.step,
            num_threads=run.cfg.loop.num_threads,
            seed=run.cfg.loop.seed,
            precision=run.plan.precision,
        ),
        critic=critic,
    )
