"""`mileage train`: print the plan, then build the run and drive the loop."""

from __future__ import annotations

from mileage.checkpoint.plan import COMPLETE
from mileage.checkpoint.store import remove_leftovers
from mileage.components import build_run, make_plan
from mileage.loop import train
from mileage.progress import RunProgress
from mileage.run_config import RunConfig


def train_command(cfg: RunConfig) -> int:
    plan, flags, prompts = make_plan(cfg)
    progress = RunProgress(plan.start_rollout_id, plan.num_rollout)
    progress.print(plan.describe())
    if plan.action == COMPLETE:
        progress.print(f"run already complete ({plan.num_rollout} of {plan.num_rollout} rollouts)")
        return 0
    if cfg.checkpoint.save:
        for name in remove_leftovers(cfg.checkpoint.save):
            progress.print(f"removed leftover of an interrupted save: {name}")
    run = build_run(cfg, plan, flags, prompts, progress.print)
    with progress:
        records = train(run, progress)
    if records and "eval_accuracy" in records[-1]:
        progress.print(f"final eval accuracy {records[-1]['eval_accuracy']:.3f}")
    return 0
