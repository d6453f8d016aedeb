"""`mileage train`: print the plan, take the save directory's lock, build the run, drive the loop."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError

from mileage.checkpoint.plan import COMPLETE, RESUME, ResumePlan
from mileage.checkpoint.store import TRAINER_STATE, remove_leftovers
from mileage.checkpoint.tensors import OLD_ACTOR_FILE
from mileage.components import build_run
from mileage.distributed import env
from mileage.distributed.coordination import run_progress, save_dir_lock
from mileage.loop import train
from mileage.preemption import STOPPED_EXIT, PreemptionGuard
from mileage.preflight import preflight, with_recorded_model
from mileage.rollout.buffer import describe_saved
from mileage.rollout.evaluation import summary
from mileage.run_config import RunConfig
from mileage.sources import build_source
from mileage.sources.dataset import check_sft_run


def reuse_line(plan: ResumePlan, asynchronous: bool = True) -> str | None:
    """What the resume takes from the checkpoint's rollout buffer (an async run's or dynamic
    sampling's; `asynchronous`: the run uses it), if any."""
    if plan.action != RESUME or not plan.load_data_state:
        return None
    try:
        line = describe_saved(plan.weights_from, TRAINER_STATE)
        if line is None or asynchronous:
            return line if line is None else line + kept_weights(plan.weights_from)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        # damaged bytes: build_run's verification of the checkpoint refuses them in one line
        return f"  note: the rollout buffer of {plan.weights_from} is unreadable"
    return (
        "  note: the checkpoint holds a rollout buffer (of train-async or dynamic sampling); "
        "`mileage train` without dynamic sampling generates on-policy and leaves it unused "
        "(continue it exactly with the command and flags that wrote it)"
    )


def kept_weights(checkpoint) -> str:
    """train-async --keep-old-actor: the weight versions the checkpoint kept for its buffer."""
    path = Path(checkpoint) / OLD_ACTOR_FILE
    if not path.is_file():
        return ""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as kept:
        versions = sorted({int(key.split("/", 1)[0]) for key in kept.keys()})  # noqa: SIM118
    # keyed by trained rollouts (the weight versions above count optimizer steps)
    return f"; kept old-actor weights after {', '.join(map(str, versions))} trained rollout(s)"


def train_command(cfg: RunConfig, asynchronous: bool = False, supervised: bool = False) -> int:
    """Under torchrun every rank runs this; rank 0 prints, holds the lock and cleans up.
    `supervised`: `mileage sft` (the dataset source)."""
    env.request_device(cfg.parallel.device)
    if asynchronous:
        cfg.validate_async()
    if supervised:
        check_sft_run(cfg)
    with env.session(host_collectives=cfg.parallel.fsdp_cpu_offload):
        return _train(cfg, asynchronous, supervised)


def _train(cfg: RunConfig, asynchronous: bool, supervised: bool = False) -> int:
    notes: list[str] = []
    cfg = with_recorded_model(cfg, notes.append)
    pre = preflight(cfg, asynchronous, supervised)
    plan = pre.plan
    progress = run_progress(plan.start_rollout_id, plan.num_rollout)
    if cfg.demo_note():
        progress.print(cfg.demo_note())
    for note in notes:
        progress.print(note)
    progress.print(plan.describe())
    progress.print(cfg.checkpoint.schedule_line(plan.num_rollout))
    if cfg.engine.note():
        progress.print(cfg.engine.note())
    if env.device().type == "cuda":
        progress.print(f"training on {env.device()} ({torch.cuda.get_device_name(env.device())})")
    reuse = reuse_line(plan, asynchronous or cfg.dynamic.enabled)
    if reuse:
        progress.print(reuse)
    save = cfg.checkpoint.save
    with save_dir_lock(save) as lock:
        if lock is not None and lock.previous_holder:
            holder = lock.previous_holder
            progress.print(
                f"took over a stale lock of {save} (pid {holder.get('pid')} on {holder.get('host')} is gone)"
            )
        if save:
            for name in remove_leftovers(save) if env.is_main() else ():
                progress.print(f"removed leftover of an interrupted save: {name}")
            env.barrier()  # the other ranks plan again only after rank 0's cleanup
            # the plan was made before taking the lock; another run may have moved the tracker.
            # Reprint it only if the decision changed, not just the wording of its reasons.
            pre = preflight(cfg, asynchronous, supervised)
            if replace(pre.plan, reasons=()) != replace(plan, reasons=()):
                plan = pre.plan
                progress.print(plan.describe())
        if plan.action == COMPLETE:
            progress.print(
                f"run already complete ({plan.num_rollout} of {plan.num_rollout} rollouts)"
            )
            return 0
        run = build_run(cfg, pre, progress.print)
        try:
            with progress:
                source = build_source(run, asynchronous, supervised)
                records, stop_reason = train(run, progress, source)
        finally:
            if run.engine is not None:
                run.engine.close()  # stops a launched server, removes synced weights
            if run.agent is not None:
                run.agent.close()  # ends the tool worker processes
    if records and summary(records[-1]):  # the last rollout evaluated
        progress.print(f"final eval: {summary(records[-1])}")
    # every rank saw the same agreed stop, so every rank exits with the same code
    return STOPPED_EXIT if stop_reason in PreemptionGuard.SIGNAL_NAMES else 0
