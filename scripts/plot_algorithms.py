"""Held-out accuracy of several runs side by side: one figure and one markdown table.

    python scripts/plot_algorithms.py --before 0.398 --out docs/algorithms.png \\
        GRPO=/tmp/alg/grpo "REINFORCE++=/tmp/alg/reinforce_plus_plus" PPO=/tmp/alg/ppo

Each NAME=SAVE_DIR is a `mileage train --save SAVE_DIR` run; its metrics.jsonl records
`eval_accuracy` at every evaluation. `--before` is the accuracy before RL, which `mileage train`
prints (`eval before training: ...`) and which all runs of the same model share.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def eval_curve(save_dir: Path) -> list[tuple[int, float]]:
    """(rollouts trained, held-out accuracy) at each evaluation of the run."""
    curve = []
    for line in (save_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("eval_accuracy") is not None:
            curve.append((record["rollout_id"] + 1, record["eval_accuracy"]))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="NAME=SAVE_DIR")
    parser.add_argument("--before", type=float, required=True, help="accuracy before RL")
    parser.add_argument("--out", required=True, help="figure path (.png)")
    args = parser.parse_args()
    curves = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        curves[name] = [(0, args.before), *eval_curve(Path(path))]

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
