"""`mileage plot RUN_DIR`: one PNG with the per-rollout curves from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from mileage.errors import UserError
from mileage.metrics import read_metrics

PANELS = (
    ("reward_mean", "reward (sampled)"),
    ("eval_accuracy", "held-out accuracy (greedy)"),
    ("kl", "KL"),
    ("entropy", "entropy"),
    ("lr", "learning rate"),
    ("step_time", "seconds / rollout"),
)


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir} is not a run directory (--save of `mileage train`)")
    records = read_metrics(run_dir)
    if not records:
        raise UserError(f"no metrics.jsonl records in {run_dir}")
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    if out.is_dir() or not out.parent.is_dir():
        raise UserError(f"--out {out}: give a file path in an existing directory")
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        points = [(r["rollout_id"], r[key]) for r in records if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o" if len(points) < 30 else None, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    fig.suptitle(f"mileage run: {Path(run_dir).resolve().name}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
