"""`mileage train`: print the plan, take the save directory's lock, build the run, drive the loop."""

from __future__ import annotations

from dataclasses import replace

import torch

from mileage.checkpoint.plan import COMPLETE
from mileage.checkpoint.store import remove_leftovers
from mileage.components import build_run, preflight, with_recorded_model
from mileage.distributed import env
from mileage.distributed.coordination import run_progress, save_dir_lock
from mileage.loop import train
from mileage.run_config import RunConfig


def train_command(cfg: RunConfig) -> int:
    """Under torchrun every rank runs this; rank 0 prints, holds the lock and cleans up."""
    env.request_device(cfg.parallel.device)
    with env.session():
        return _train(cfg)


def _train(cfg: RunConfig) -> int:
    notes: list[str] = []
    cfg = with_recorded_model(cfg, notes.append)
    pre = preflight(cfg)
    plan = pre.plan
    progress = run_progress(plan.start_rollout_id, plan.num_rollout)
    if cfg.demo_note():
        progress.print(cfg.demo_note())
    for note in notes:
        progress.print(note)
    progress.print(plan.describe())
    if cfg.engine.note():
        progress.print(cfg.engine.note())
    if env.device().type == "cuda":
        progress.print(f"training on {env.device()} ({torch.cuda.get_device_name(env.device())})")
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
            pre = preflight(cfg)
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
                records = train(run, progress)
        finally:
            if run.engine is not None:
                run.engine.close()  # stops a launched server, removes synced weights
    if records and records[-1].get("eval_accuracy") is not None:
        progress.print(f"final eval accuracy {records[-1]['eval_accuracy']:.3f}")
    return 0
