"""Held-out accuracy of several runs side by side: one figure and one markdown table.

    python scripts/plot_algorithms.py --before 0.398 --out docs/algorithms.png \\
        GRPO=/tmp/alg/grpo "REINFORCE++=/tmp/alg/reinforce_plus_plus" PPO=/tmp/alg/ppo

Each NAME=SAVE_DIR is a `mileage train --save SAVE_DIR` run; its metrics.jsonl records
`eval_accuracy` at every evaluation, the one before training included (rollout_id -1, drawn at
0 rollouts trained). `--before` supplies that starting point for runs whose metrics.jsonl lacks
it (written before mileage recorded it, or run with --skip-eval-before-train).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def eval_curve(save_dir: Path) -> list[tuple[int, float]]:
    """(rollouts trained, held-out accuracy) at each evaluation of the run; the evaluation before
    training (rollout_id -1) is the point at 0 rollouts trained."""
    curve = []
    for line in (save_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("eval_accuracy") is not None:
            curve.append((record["rollout_id"] + 1, record["eval_accuracy"]))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="NAME=SAVE_DIR")
    parser.add_argument(
        "--before", type=float, help="accuracy before RL, for runs that did not record it"
    )
    parser.add_argument("--out", required=True, help="figure path (.png)")
    args = parser.parse_args()
    curves = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        curve = eval_curve(Path(path))
        if not curve or curve[0][0] != 0:
            if args.before is None:
                parser.error(f"{path} has no evaluation before training: give --before")
            curve = [(0, args.before), *curve]
        curves[name] = curve

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, curve in curves.items():
        ax.plot([x for x, _ in curve], [y for _, y in curve], marker="o", label=name)
    ax.set_xlabel("rollouts trained")
    ax.set_ylabel("held-out greedy accuracy (500 sums)")
    ax.set_title("built-in addition task, 16 prompts x 8 samples per rollout")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)

    steps = [x for x, _ in next(iter(curves.values()))]
    print("| rollouts | " + " | ".join(curves) + " |")
    print("|---:|" + "---:|" * len(curves))
    for i, step in enumerate(steps):
        row = [f"{curve[i][1]:.3f}" if i < len(curve) else "-" for curve in curves.values()]
        print(f"| {step} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
