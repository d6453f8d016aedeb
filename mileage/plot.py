"""`mileage plot RUN_DIR`: one PNG with the per-rollout curves from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from mileage.errors import UserError
from mileage.metrics import read_metrics

# (keys drawn in the panel, title); a panel of several keys gets a legend of their LABELS
PANELS = (
    (("reward_mean",), "reward (sampled)"),
    # the evaluation before training is the record of rollout -1: the curve's first point
    # eval_accuracy: the mean reward (also eval_reward), read under the key every run has
    (("eval_accuracy",), "held-out mean reward (greedy)"),
    (("ppo_kl", "kl"), "policy drift and KL"),
    (("entropy",), "entropy"),
    (("lr",), "learning rate"),
    (("step_time",), "seconds / rollout"),
    (("mem_peak_gib", "mem_estimate_gib"), "memory per rank (GiB)"),
)
LABELS = {
    "ppo_kl": "ppo_kl: drift from the sampling policy",
    "kl": "kl: KL to the reference model",
    "mem_peak_gib": "peak RSS (measured)",
    "mem_estimate_gib": "estimate (the plan's model)",
}


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir} is not a run directory (--save of `mileage train`)")
    records = read_metrics(run_dir)
    if not records:
        raise UserError(f"no metrics.jsonl records in {run_dir}")
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    if out.is_dir() or not out.parent.is_dir():
        raise UserError(f"--out {out}: give a file path in an existing directory")
    fig = draw_metrics(records, f"mileage run: {Path(run_dir).resolve().name}")
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise UserError(f"cannot write --out {out}: {exc.strerror}") from None
    finally:
        plt.close(fig)
    return out


def draw_metrics(records: list[dict], title: str):
    """The figure of `mileage plot`: one panel per PANELS entry, x = rollout id."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = -(-len(PANELS) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.25 * rows))
    for ax in axes.flat[len(PANELS) :]:
        ax.set_visible(False)
    for ax, (keys, panel_title) in zip(axes.flat, PANELS, strict=False):
        curves = panel_curves(records, keys)
        for key, (xs, ys) in curves.items():
            marker = "o" if len(xs) < 30 else None
            ax.plot(xs, ys, marker=marker, linewidth=1.2, label=LABELS.get(key, key))
        if curves and len(keys) > 1:
            ax.legend(fontsize="small")
        ax.set_title(panel_title)
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def panel_curves(
    records: list[dict], keys: tuple[str, ...]
) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (rollout ids, values) for each key some record holds, in rollout order."""
    curves = {}
    for key in keys:
        points = sorted((r["rollout_id"], r[key]) for r in records if r.get(key) is not None)
        if points:
            curves[key] = ([x for x, _ in points], [y for _, y in points])
    return curves
