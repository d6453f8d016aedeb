"""The parts of a run that take loading and wiring: the policy (full weights or base + LoRA
adapter, and the reference), the rollout engine around it, the checkpoint writer, and the one
integrity check of everything a run restores. `components.build_run` puts them together."""

from __future__ import annotations

from pathlib import Path

import torch

from mileage.checkpoint.plan import RESUME, ResumePlan
from mileage.checkpoint.store import CheckpointWriteError, require_intact
from mileage.checkpoint.tensors import load_model_weights
from mileage.checkpoint.writer import CheckpointWriter
from mileage.distributed import env
from mileage.distributed.checkpoint import ShardedCheckpointWriter
from mileage.distributed.setup import load_on_rank0
from mileage.models.gated_mlp import use_gated_silu
from mileage.models.hf import empty_causal_lm, load_causal_lm
from mileage.precision import set_precision
from mileage.rollout.engines.base import Engine
from mileage.rollout.engines.factory import build_engine
from mileage.rollout.journal import ToolJournal
from mileage.run_config import RunConfig
from mileage.training.lora import LoraPolicy, build_lora_policy, refuse_adapter_without_lora
from mileage.training.lora_sync import AdapterSyncEngine, MergedWeightsEngine, takes_adapters


def verify_sources(sources: list[tuple]) -> None:
    """Every native checkpoint among (path, format[, the flag that picks another]) `sources`,
    each verified once as a whole (`store.require_intact`) before any of its parts loads: the
    loaders after it trust the bytes."""
    seen = set()
    for path, fmt, *flag in sources:
        if path and fmt == "native" and Path(path).resolve() not in seen:
            seen.add(Path(path).resolve())
            require_intact(path, *flag)


def plan_sources(plan: ResumePlan, reference: tuple[str | None, str | None]) -> list:
    """What a run reads: the plan's weights (a resume: also its optimizer, RNG, trainer state,
    buffer and kept old actors), the reference or LoRA base, PPO's critic checkpoint and the
    OPD teacher."""
    critic = (plan.critic_from, "native") if plan.critic else (None, None)
    teacher = (plan.teacher_from, plan.teacher_format, "--opd-teacher-ckpt-step")
    return [(plan.weights_from, plan.weights_format), reference, critic, teacher]


def load_weights(path: str, fmt: str, config_dir: str) -> torch.nn.Module:
    """The weights at `path`; a native checkpoint must have passed `verify_sources` first."""
    if fmt == "hf":
        return load_causal_lm(path)
    model = empty_causal_lm(config_dir)
    load_model_weights(path, model)
    return model


def _load(path: str, fmt: str, config_dir: str) -> torch.nn.Module:
    """The weights at `path`; under torchrun only rank 0 reads them (`load_on_rank0`)."""
    if not env.is_distributed():
        return load_weights(path, fmt, config_dir)
    return load_on_rank0(lambda: load_weights(path, fmt, config_dir), config_dir)


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


def load_policy(
    cfg: RunConfig, plan: ResumePlan, reference_from: tuple, config_dir: str, log
) -> tuple[torch.nn.Module, torch.nn.Module | None, LoraPolicy | None]:
    """The policy in the plan's precision on this process's device, the reference when the
    algorithm needs one, and with --lora-rank the LoRA policy (base + adapter)."""
    ref_path, ref_fmt = reference_from
    reference, lora = None, None
    if cfg.lora.enabled:
        lora = build_lora_policy(
            cfg.lora,
            cfg.loop.seed,
            (plan.weights_from, plan.weights_format),
            (ref_path, ref_fmt),
            plan.action == RESUME,
            lambda path, fmt: load_weights(path, fmt, config_dir),
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
    use_gated_silu(model)  # the same numbers, one activation fewer kept per MLP
    if cfg.algo.needs_reference and lora is None:
        reference = _load(ref_path, ref_fmt, config_dir).requires_grad_(False)
        set_precision(reference, plan.precision)
        log(f"reference model: {ref_path} ({ref_fmt})")
    if not env.is_distributed():
        # one process: the GPU whenever --device allows it (torchrun ranks move in shard_model)
        model.to(env.device())
        if reference is not None:
            reference.to(env.device())
    return model, reference, lora


def load_teacher(plan: ResumePlan, config_dir: str, log) -> torch.nn.Module | None:
    """--use-opd: the frozen teacher in the plan's precision (None without). An HF teacher
    brings its own architecture; a native one is the student's (`plan_teacher` checked it)."""
    if plan.teacher_from is None:
        return None
    architecture = plan.teacher_from if plan.teacher_format == "hf" else config_dir
    teacher = _load(plan.teacher_from, plan.teacher_format, architecture).requires_grad_(False)
    set_precision(teacher, plan.precision)
    if not env.is_distributed():  # torchrun ranks shard it (components.build_run)
        teacher.to(env.device())
    log(f"teacher model: {plan.teacher_from} ({plan.teacher_format})")
    return teacher


def rollout_engine(
    cfg: RunConfig, model: torch.nn.Module, tokenizer, lora: LoraPolicy | None, config_dir: str, log
) -> Engine | None:
    """The engine that generates with `model`'s weights (None when replaying saved rollouts);
    a LoRA run's remote engines get the adapter alone or merged weights."""
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
    return engine


def checkpoint_writer(
    cfg: RunConfig, num_rollout: int, journal: ToolJournal, config_dir: str, log
) -> CheckpointWriter | None:
    """The writer of --save (None without), on the save schedule; after each commit it
    exports --save-hf and prunes the tool journal."""
    if not cfg.checkpoint.save:
        return None
    return (ShardedCheckpointWriter if env.is_distributed() else CheckpointWriter)(
        cfg.checkpoint.save,
        cfg.checkpoint.save_keep_last,
        cfg.checkpoint.async_save,
        on_commit=_on_commit(_hf_exporter(cfg.checkpoint.save_hf, config_dir, log), journal),
        schedule=cfg.checkpoint.schedule(num_rollout, env.any_rank),
    )
