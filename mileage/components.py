"""Builds the parts of a run from its config and plan (made in `preflight.py`), restores them,
and captures their state.

Everything here is plumbing; the algorithm itself reads top to bottom in `loop.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

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
from mileage.checkpoint.store import (
    TRAINER_STATE,
    CheckpointState,
    CheckpointWriteError,
    read_json,
    require_intact,
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
from mileage.distributed.coordination import stop_together
from mileage.distributed.setup import distribute_run, load_on_rank0
from mileage.metrics import MetricsLog
from mileage.models.hf import (
    empty_causal_lm,
    load_causal_lm,
    load_tokenizer,
    read_config_json,
)
from mileage.models.lora import MergedView, adapter_tensors
from mileage.models.tensors import model_tensors
from mileage.precision import set_precision
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
from mileage.rollout.engines.factory import build_engine
from mileage.rollout.journal import JOURNAL_DIR, ToolJournal
from mileage.rollout.rewards import RewardFn
from mileage.rollout.rollout import PromptEncoder
from mileage.rollout.sizes import context_length
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
from mileage.training.lora import LoraPolicy, build_lora_policy, refuse_adapter_without_lora
from mileage.training.lora_sync import AdapterSyncEngine, MergedWeightsEngine, takes_adapters
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
    wandb_run_id: str | None  # kept in the trainer state, so a resumed run continues the W&B run
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

    @property
    def model(self) -> torch.nn.Module:
        return self.actor.model

    @property
    def device(self) -> torch.device:
        """Where the policy trains: this rank's GPU when --device allows it, else the CPU."""
        return next(self.model.parameters()).device


def verify_sources(sources: list[tuple[str | None, str | None]]) -> None:
    """Every native checkpoint among (path, format) `sources`, each verified once as a whole
    (`store.require_intact`) before any of its parts loads: the loaders after it trust the bytes."""
    seen = set()
    for path, fmt in sources:
        if path and fmt == "native" and Path(path).resolve() not in seen:
            seen.add(Path(path).resolve())
            require_intact(path)


def _plan_sources(plan: ResumePlan, reference: tuple[str | None, str | None]) -> list:
    """What a run reads: the plan's weights (a resume: also its optimizer, RNG, trainer state,
    buffer and kept old actors), the reference or LoRA base, and PPO's critic checkpoint."""
    critic = (plan.critic_from, "native") if plan.critic else (None, None)
    return [(plan.weights_from, plan.weights_format), reference, critic]


def _load_weights(path: str, fmt: str, config_dir: str) -> torch.nn.Module:
    """The weights at `path`; a native checkpoint must have passed `verify_sources` first."""
    if fmt == "hf":
        return load_causal_lm(path)
    model = empty_causal_lm(config_dir)
    load_model_weights(path, model)
    return model


def _load(path: str, fmt: str, config_dir: str) -> torch.nn.Module:
    """The weights at `path`; under torchrun only rank 0 reads them (`load_on_rank0`)."""
    if not env.is_distributed():
        return _load_weights(path, fmt, config_dir)
    return load_on_rank0(lambda: _load_weights(path, fmt, config_dir), config_dir)


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


def _on_commit(export, journal: ToolJournal):
    """After a checkpoint of rollout N commits: the --save-hf export, then the tool journal
    drops slots <= N (a resume starts after N, so nothing generates them again)."""

    def committed(rollout_id: int, checkpoint) -> None:
        if export is not None:
            export(rollout_id, checkpoint)
        if env.is_main():
            journal.prune(rollout_id + 1)

    return committed


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
    sources = _plan_sources(plan, (ref_path, ref_fmt))
    stop_together(lambda: verify_sources(sources) if env.is_main() else None)
    reference, lora = None, None
    if cfg.lora.enabled:
        lora = build_lora_policy(
            cfg.lora,
            cfg.loop.seed,
            (plan.weights_from, plan.weights_format),
            (ref_path, ref_fmt),
            plan.action == RESUME,
            lambda path, fmt: _load_weights(path, fmt, config_dir),
            log,
        )
        model = lora.model
        if cfg.algo.needs_reference:
            reference = lora.reference()
            log(f"reference model: the base {lora.base['path']} (adapter disabled)")
    else:
        refuse_adapter_without_lora(plan.weights_from, plan.weights_format)
        model = _load(plan.weights_from, plan.weights_format, config_dir)
    # every copy made from here on (critic body, generation copy) inherits the precision
    set_precision(model, plan.precision, cfg.precision.fp32_lm_head)
    if cfg.algo.needs_reference and lora is None:
        reference = _load(ref_path, ref_fmt, config_dir).requires_grad_(False)
        set_precision(reference, plan.precision)
        log(f"reference model: {ref_path} ({ref_fmt})")
    if not env.is_distributed():
        # one process: the GPU whenever --device allows it (torchrun ranks move in shard_model)
        model.to(env.device())
        if reference is not None:
            reference.to(env.device())
    eos = tokenizer.eos_token_id
    engine = None
    if not cfg.rollout.load_debug_rollout_data:
        engine = build_engine(cfg.engine, model, tokenizer.pad_token_id, eos, config_dir, log)
        if lora is not None and not engine.in_process and not env.is_distributed():
            # the adapter alone where the engine takes adapters, else merged weights (under
            # torchrun: distributed/lora_remote.py, once the policy is sharded)
            engine = (
                AdapterSyncEngine(engine, lora, config_dir, cfg.lora.lora_sync_from_tensor, log)
                if takes_adapters(engine)
                else MergedWeightsEngine(engine, lora, config_dir, log)
            )
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
            model=value_model,
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
        dropout_seed=cfg.loop.seed if lora is not None and cfg.lora.lora_dropout else None,
        finite=cfg.finite,
    )
    resumed = read_json(plan.weights_from, TRAINER_STATE) if plan.action == RESUME else {}
    wandb_run_id = resumed.get("tracking", {}).get("wandb_run_id")
    if wandb_run_id is None and cfg.tracking.use_wandb:
        wandb_run_id = new_wandb_run_id()
    # the tool journal of multi-turn runs; a committed checkpoint prunes what it made redundant
    journal = ToolJournal(Path(cfg.checkpoint.save) / JOURNAL_DIR if cfg.checkpoint.save else None)
    metrics_dir = cfg.checkpoint.save if env.is_main() else None  # rank 0 logs for all
    writer = None
    if cfg.checkpoint.save:
        writer = (ShardedCheckpointWriter if env.is_distributed() else CheckpointWriter)(
            cfg.checkpoint.save,
            cfg.checkpoint.save_keep_last,
            cfg.checkpoint.async_save,
            on_commit=_on_commit(_hf_exporter(cfg.checkpoint.save_hf, config_dir, log), journal),
            schedule=cfg.checkpoint.schedule(plan.num_rollout, env.any_rank),
        )
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
    data = PromptSource(pre.prompts, cfg.data.rollout_shuffle, cfg.loop.seed)
    buffer = new_buffer(cfg.dynamic, plan.start_rollout_id)
    parts = StateRegistry()
    parts.register("actor", actor)
    parts.register("data", data, DATA)
    if critic is not None:
        parts.register("critic", critic, CRITIC)  # its tensors: critic/ of the checkpoint
    if wandb_run_id:  # only then: runs without W&B keep byte-identical trainer states
        parts.register("tracking", Recorded({"wandb_run_id": wandb_run_id}))
    if buffer is not None:  # dynamic sampling's kept groups belong to the data position
        parts.register(STATE_KEY, buffer, DATA)
    return Run(
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
        wandb_run_id=wandb_run_id,
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
        ),
        critic=critic,
    )
