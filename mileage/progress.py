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

from mileage.rollout.evaluation import summary


def summary_line(record: dict) -> str:
    """A rollout's line. "reward" is the mean reward, "solved" the share of answers with reward
    >= 1 (the record's `accuracy`): with rewards other than 0/1 the two differ."""
    parts = [f"rollout {record['rollout_id']}"]
    if "sft_loss" in record:  # `mileage sft`: the data's answers, nothing scored
        parts.append(f"sft loss {record['sft_loss']:.4f}")
    else:
        parts += [f"reward {record['reward_mean']:.3f}", f"solved {record['accuracy']:.3f}"]
    # a PPO critic-only rollout (--num-critic-only-steps) has no policy loss, drift or entropy
    if "ppo_kl" in record:
        parts.append(f"ppo_kl {record['ppo_kl']:+.2e}")
    if "kl" in record:  # only with a reference model: the KL to it
        parts.append(f"kl {record['kl']:+.2e}")
    if "opd_reverse_kl" in record:  # --use-opd: student - teacher log-prob per token
        parts.append(f"teacher kl {record['opd_reverse_kl']:+.2e}")
    if "entropy" in record:
        parts.append(f"entropy {record['entropy']:.3f}")
    if "value_loss" in record:
        parts.append(f"value loss {record['value_loss']:.3f}")
    parts.append(f"lr {record['lr']:.2e}")
    # train-async: None when every group came from a checkpoint (nobody timed its generation)
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    if "staleness_mean" in record:  # train-async: optimizer steps behind the trained weights
        parts.append(f"staleness {record['staleness_mean']:.2g} (max {record['staleness_max']})")
    parts.append(f"{record['step_time']:.2f}s")
    evaluated = summary(record)
    if evaluated:
        parts.append(f"eval {evaluated}")
    if "saved" in record:
        parts.append("saved")
    return " | ".join(parts)


def restored_line(
    source: str, iteration: int | None, optimizer_step: int, data: dict | None
) -> str:
    """What a resume loaded from checkpoint `source` (`iteration` when it is an iter_N one):
    the optimizer step and, when restored (`data`: PromptSource.state_dict), the data
    position, whose digest is cut to what a person compares by eye."""
    where = f"iteration {iteration} ({source})" if iteration is not None else source
    line = f"restored {where}: optimizer step {optimizer_step}"
    if data is not None:
        order = "shuffled" if data.get("shuffle") else "in file order"
        line += (
            f", data epoch {data['epoch']} at prompt {data['offset']} of {data['size']} ({order}"
        )
        line += f", digest {data['digest'][:8]})" if data.get("digest") else ")"
    return line


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
