"""`mileage train`: print the plan, take the save directory's lock, build the run, drive the loop."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

from mileage.checkpoint.lock import SaveDirLock
from mileage.checkpoint.plan import COMPLETE
from mileage.checkpoint.store import remove_leftovers
from mileage.components import build_run, preflight, with_recorded_model
from mileage.loop import train
from mileage.progress import RunProgress
from mileage.run_config import RunConfig


def train_command(cfg: RunConfig) -> int:
    notes: list[str] = []
    cfg = with_recorded_model(cfg, notes.append)
    pre = preflight(cfg)
    plan = pre.plan
    progress = RunProgress(plan.start_rollout_id, plan.num_rollout)
    for note in notes:
        progress.print(note)
    progress.print(plan.describe())
    save = cfg.checkpoint.save
    with SaveDirLock(save) if save else nullcontext() as lock:
        if lock is not None and lock.previous_holder:
            holder = lock.previous_holder
            progress.print(
                f"took over a stale lock of {save} (pid {holder.get('pid')} on {holder.get('host')} is gone)"
            )
        if save:
            for name in remove_leftovers(save):
                progress.print(f"removed leftover of an interrupted save: {name}")
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
        with progress:
            records = train(run, progress)
    if records and records[-1].get("eval_accuracy") is not None:
        progress.print(f"final eval accuracy {records[-1]['eval_accuracy']:.3f}")
    return 0
