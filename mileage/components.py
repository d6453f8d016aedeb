"""Builds the parts of a run from its config and plan (made in `preflight.py`), restores them,
and captures their state.

Everything here is plumbing; the algorithm itself reads top to bottom in `loop.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from mileage.build import (
    checkpoint_writer,
    load_policy,
    load_teacher,
    plan_sources,
    rollout_engine,
    verify_sources,
)
from mileage.checkpoint.meta import (
    checkpoint_meta,
    model_source,
)
from mileage.checkpoint.plan import (
    RESUME,
    ResumePlan,
    gather_disk_state,
    reference_source,
)
from mileage.checkpoint.registry import CRITIC, DATA, RUN, Recorded, StateRegistry
from mileage.checkpoint.stages import stage_meta
from mileage.checkpoint.store import (
    TRAINER_STATE,
    CheckpointState,
    read_json,
)
from mileage.checkpoint.tensors import (
    load_optimizer_tensors,
    load_rng_tensors,
    optimizer_tensors,
)
from mileage.checkpoint.writer import CheckpointWriter
from mileage.distributed import env
from mileage.distributed.checkpoint import rng_of_this_rank
from mileage.distributed.coordination import stop_together
from mileage.distributed.parallelize import shard_from_rank0
from mileage.distributed.remote import once_for_all_ranks
from mileage.distributed.setup import distribute_run
from mileage.metrics import MetricsLog
from mileage.models.activation_checkpointing import enable_activation_checkpointing
from mileage.models.hf import (
    load_tokenizer,
    read_config_json,
)
from mileage.models.lora import MergedView, adapter_tensors
from mileage.models.tensors import model_tensors
from mileage.preflight import Preflight
from mileage.progress import restored_line
from mileage.rollout.agent import DEFAULT_CONTEXT, Agent
from mileage.rollout.buffer import STATE_KEY, RolloutBuffer
from mileage.rollout.builtin_model import (
    ensure_builtin_model,
)
from mileage.rollout.data import (
    EvalSet,
    PromptSource,
)
from mileage.rollout.dynamic import (
    BufferFilter,
    GroupFilter,
    new_buffer,
)
from mileage.rollout.engine import SamplingParams
from mileage.rollout.engines.base import Engine
from mileage.rollout.journal import JOURNAL_DIR, ToolJournal
from mileage.rollout.rewards import RewardFn
from mileage.rollout.rollout import PromptEncoder
from mileage.rollout.sizes import context_length
from mileage.rollout.teacher import ServedTeacher
from mileage.run_config import RunConfig
from mileage.seeding import capture_rng_state, configure_determinism, restore_rng_state
from mileage.tracking import build_trackers, new_wandb_run_id
from mileage.training.actor import Actor
from mileage.training.critic import (
    build_critic,
    build_value_model,
    critic_checkpoint_state,
    restore_critic_optimizer,
)
from mileage.training.distill import SERVED
from mileage.training.lora import LoraPolicy
from mileage.training.lora_sync import takes_adapters
from mileage.training.memory import MemoryPlan
from mileage.training.optimizer import build_optimizer, build_schedule


@dataclass
class Run:
    cfg: RunConfig
    plan: ResumePlan
    tokenizer: object
    encode: PromptEncoder
    actor: Actor
    engine: Engine | None  # None when replaying saved rollout data
    data: PromptSource
    eval_sets: list[EvalSet]
    reward_fn: RewardFn
    sampling: SamplingParams
    writer: CheckpointWriter | None
    metrics: MetricsLog
    model_config: dict
    model_source: dict  # what meta.json records the run was trained from
    lora: LoraPolicy | None = None  # --lora-rank: the model is the base with a PEFT adapter
    # the rollout buffer, saved with the data position: dynamic sampling's groups kept beyond
    # a rollout's batch, or train-async's groups generated ahead
    buffer: RolloutBuffer | None = None
    group_filter: GroupFilter | None = None
    buffer_filter: BufferFilter | None = None
    # how prompts become scored samples (single-turn, a generate function, the tool loop)
    agent: Agent | None = None
    # every part whose state the checkpoint's trainer state holds, registered once
    parts: StateRegistry = field(default_factory=StateRegistry)
    # the memory estimate behind the micro-batch: each rollout logs its own beside its peak
    memory: MemoryPlan | None = None
    # --use-opd --opd-type sglang: the teacher server that scores each rollout's samples
    teacher: ServedTeacher | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.actor.model

    @property
    def device(self) -> torch.device:
        """Where the policy trains: this rank's GPU when --device allows it, else the CPU."""
        return next(self.model.parameters()).device


def build_run(cfg: RunConfig, pre: Preflight, log) -> Run:
    plan, flags = pre.plan, pre.flags
    configure_determinism(cfg.loop.seed, cfg.loop.num_threads)
    if not cfg.checkpoint.hf_checkpoint:
        ensure_builtin_model(cfg.data.builtin_task, log=log)
    config_dir = flags.hf_checkpoint
    tokenizer = load_tokenizer(config_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    ref_path, ref_fmt = None, None
    if cfg.lora.enabled or cfg.algo.needs_reference:  # a LoRA base is the reference's source
        ref_path, ref_fmt = reference_source(flags, gather_disk_state(flags, None))
    # the one integrity check of everything this run restores, before anything loads
    sources = plan_sources(plan, (ref_path, ref_fmt))
    stop_together(lambda: verify_sources(sources) if env.is_main() else None)
    model, reference, lora = load_policy(cfg, plan, (ref_path, ref_fmt), config_dir, log)
    teacher = load_teacher(plan, config_dir, log)
    engine = rollout_engine(cfg, model, tokenizer, lora, config_dir, log)
    # PPO: the critic starts from the actor's loaded weights (a LoRA actor's merged), so it is
    # copied before sharding
    value_model = None
    if plan.critic:
        start = MergedView(lora.peft_model, config_dir).model if lora else None
        value_model = stop_together(
            lambda: build_value_model(
                model, plan.critic_from, config_dir, cfg.loop.seed, start_from=start
            )
        )
    if cfg.parallel.gradient_checkpointing:  # before sharding, as torchtitan applies it
        layers = enable_activation_checkpointing(model, value_model)
        log(f"activation checkpointing: {layers} decoder layers recompute their forward")
    if env.is_distributed():  # FSDP2 over the ranks, and the engine wrapped for them
        model, reference, engine = distribute_run(
            model,
            reference,
            value_model,
            engine,
            lora,
            cfg.parallel,
            cfg.rollout.n_samples_per_prompt,
            from_tensor=cfg.lora.lora_sync_from_tensor,
            adapters=engine is not None and lora is not None and takes_adapters(engine),
            log=log,
        )
        if teacher is not None:  # sharded as the reference is
            shard_from_rank0(teacher, cfg.parallel)
    optimizer = build_optimizer(model, cfg.optim)
    # the micro-batch the plan settled (given, saved by the run, or chosen from memory)
    algo = replace(cfg.algo, micro_batch_size=plan.micro_batch or cfg.algo.micro_batch_size)
    steps_per_rollout = (
        cfg.rollout.samples_per_rollout // cfg.algo.batch_sizes(cfg.rollout.samples_per_rollout)[0]
    )
    schedule = build_schedule(cfg.optim, plan.num_rollout * steps_per_rollout)
    critic = None
    if plan.critic:
        critic = build_critic(
            cfg.critic,
            cfg.optim,
            algo,
            model,
            plan.critic_from,
            config_dir,
            cfg.loop.seed,
            plan.num_rollout * steps_per_rollout,
            cfg.optim.clip_grad,
            model=value_model,
        )
        log(f"critic: {plan.critic_from or 'the actor weights'} + value head")
    actor = Actor(
        model,
        optimizer,
        schedule,
        algo,
        temperature=cfg.rollout.rollout_temperature or 1.0,
        group_size=cfg.rollout.n_samples_per_prompt,
        clip_grad=cfg.optim.clip_grad,
        reference=reference,
        critic=critic,
        dropout_seed=cfg.loop.seed if lora is not None and cfg.lora.lora_dropout else None,
        finite=cfg.finite,
        teacher=teacher,
        opd_kl_coef=cfg.opd.opd_kl_coef,
    )
    resumed = read_json(plan.weights_from, TRAINER_STATE) if plan.action == RESUME else {}
    wandb_run_id = resumed.get("tracking", {}).get("wandb_run_id")
    if wandb_run_id is None and cfg.tracking.use_wandb:
        wandb_run_id = new_wandb_run_id()
    # the tool journal of multi-turn runs; a committed checkpoint prunes what it made redundant
    journal = ToolJournal(Path(cfg.checkpoint.save) / JOURNAL_DIR if cfg.checkpoint.save else None)
    metrics_dir = cfg.checkpoint.save if env.is_main() else None  # rank 0 logs for all
    writer = checkpoint_writer(cfg, plan.num_rollout, journal, config_dir, log)
    encode = PromptEncoder(tokenizer, cfg.data.apply_chat_template)
    model_config = read_config_json(config_dir)
    agent = Agent(
        cfg,
        pre.user_functions,
        tokenizer,
        encode,
        pre.reward_fn,
        journal,
        context_length(model_config) or DEFAULT_CONTEXT,
        model_config.get("vocab_size"),
    )
    agent.score_once = once_for_all_ranks(engine)
    served = None
    if cfg.opd.use_opd and cfg.opd.opd_type == SERVED:
        served = ServedTeacher(
            cfg.opd.opd_teacher_url,
            cfg.opd.opd_teacher_timeout,
            cfg.opd.opd_teacher_attempts,
            journal,
            cfg.rollout.rollout_temperature or 1.0,
            log,
        )
    data = PromptSource(pre.prompts, cfg.data.rollout_shuffle, cfg.loop.seed)
    buffer = new_buffer(cfg.dynamic, plan.start_rollout_id)
    parts = StateRegistry()
    parts.register("actor", actor)
    parts.register("data", data, DATA)
    if critic is not None:
        parts.register("critic", critic, CRITIC)  # its tensors: critic/ of the checkpoint
    if wandb_run_id:  # in the trainer state, so a resumed run continues the W&B run (only
        # then: runs without W&B keep byte-identical trainer states)
        parts.register("tracking", Recorded({"wandb_run_id": wandb_run_id}))
    if buffer is not None:  # dynamic sampling's kept groups belong to the data position
        parts.register(STATE_KEY, buffer, DATA)
    return Run(
        memory=pre.memory,
        teacher=served,
        cfg=cfg,
        plan=plan,
        tokenizer=tokenizer,
        encode=encode,
        actor=actor,
        engine=engine,
        data=data,
        eval_sets=pre.eval_sets,
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
        model_config=model_config,
        model_source=model_source(
            config_dir, None if cfg.checkpoint.hf_checkpoint else cfg.data.builtin_task
        ),
        lora=lora,
        buffer=buffer,
        group_filter=pre.group_filter,
        buffer_filter=pre.buffer_filter,
        agent=agent,
        parts=parts,
    )


def restore(run: Run, log) -> None:
    """Load what the plan says beyond the weights (already loaded by build_run): the registered
    parts of the plan's groups, then the optimizer and RNG tensors."""
    plan = run.plan
    run.metrics.truncate_from(plan.start_rollout_id)
    if plan.action != RESUME:
        return
    trainer = read_json(plan.weights_from, TRAINER_STATE)
    groups = {
        RUN,
        *([DATA] if plan.load_data_state else []),
        *([CRITIC] if plan.critic_state else []),
    }
    run.parts.load_state_dict(trainer, groups, plan.weights_from)
    if plan.critic_state and plan.load_optimizer:
        restore_critic_optimizer(run.actor.critic, plan.weights_from)
    if plan.load_optimizer:
        load_optimizer_tensors(plan.weights_from, run.model, run.actor.optimizer)
    if plan.load_rng:
        restore_rng_state(rng_of_this_rank(load_rng_tensors(plan.weights_from)), trainer["rng"])
    data = trainer["data"] if plan.load_data_state else None
    log(restored_line(plan.weights_from, plan.iteration, run.actor.step, data))


def checkpoint_state(run: Run, rollout_id: int) -> CheckpointState:
    rng_tensors, rng_plain = capture_rng_state()
    trainer = {**run.parts.state_dict(), "rng": rng_plain}
    critic = None
    if run.actor.critic is not None:
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
    extra = {"lora": run.lora.record} if run.lora is not None else {}
    return CheckpointState(
        # LoRA: the adapter alone; the base is recorded in meta.json, not copied
        model=adapter_tensors(run.model) if run.lora is not None else model_tensors(run.model),
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
            settings=dict(run.cfg.trajectory_settings()),
            **extra,
            precision=run.plan.precision,
            micro_batch_size=run.actor.algo.micro_batch_size,
            **stage_meta(run.plan.stage),  # only SFT runs record theirs
        ),
        critic=critic,
    )
