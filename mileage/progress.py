"""What the user sees while training: a live progress bar with ETA and one summary line per rollout."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def summary_line(record: dict) -> str:
    parts = [
        f"rollout {record['rollout_id']}",
        f"reward {record['reward_mean']:.3f}",
        f"acc {record['accuracy']:.3f}",
    ]
    # a PPO critic-only rollout (--num-critic-only-steps) has no policy loss, drift or entropy
    if "ppo_kl" in record:
        parts.append(f"ppo_kl {record['ppo_kl']:+.2e}")
    if "kl" in record:  # only with a reference model: the KL to it
        parts.append(f"kl {record['kl']:+.2e}")
    if "entropy" in record:
        parts.append(f"entropy {record['entropy']:.3f}")
    if "value_loss" in record:
        parts.append(f"value loss {record['value_loss']:.3f}")
    parts += [
        f"lr {record['lr']:.2e}",
        f"{record['tokens_per_s']:.0f} tok/s",
        f"{record['step_time']:.2f}s",
    ]
    if "eval_accuracy" in record:
        parts.append(f"eval acc {record['eval_accuracy']:.3f}")
    else:  # several evaluation datasets: each one's mean reward
        parts += [
            f"{key} {value:.3f}"
            for key, value in record.items()
            if key.count("/") == 1 and key.startswith("eval/")
        ]
    if "saved" in record:
        parts.append("saved")
    return " | ".join(parts)


class RunProgress:
    """Rich progress over rollouts; the phase (generate/train/save/eval) shows in the description."""

    def __init__(self, start: int, total: int, enabled: bool | None = None):
        self.console = Console(stderr=False, highlight=False)
        enabled = sys.stdout.isatty() if enabled is None else enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not enabled,
            transient=True,
        )
        self.task = self.progress.add_task("starting", total=total, completed=start)

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def phase(self, rollout_id: int, name: str) -> None:
        self.progress.update(self.task, description=f"rollout {rollout_id}: {name}")

    def done(self, record: dict) -> None:
        self.progress.advance(self.task)
        self.print(summary_line(record))

    def print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
