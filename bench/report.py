"""Draws docs/benchmarks.png from the JSON the four benchmarks wrote to bench/results/.

    python bench/report.py

One panel per benchmark, mileage beside its baseline from the same run: RL step time against
TRL's GRPOTrainer, generation throughput against `transformers` generate, checkpoint bandwidth
against dd and torch.save/torch.load, and launch-to-first-rollout latency of a resume against a
fresh start. A missing results file leaves its panel empty with a note instead of failing.
"""

from __future__ import annotations

import json
import sys

from _common import REPO, RESULTS

OUT = REPO / "docs" / "benchmarks.png"
MILEAGE, BASELINE, RAW = "#2b6cb0", "#a0aec0", "#4a5568"


def rows(name: str) -> list[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def bars(ax, labels: list[str], series: list[tuple[str, list[float], str]], unit: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values, color) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        drawn = ax.bar(xs, values, width, label=name, color=color)
        ax.bar_label(drawn, fmt="%.4g", fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)


def empty(ax, title: str, name: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, f"no bench/results/{name}.json", ha="center", transform=ax.transAxes)


def rl_step(ax) -> None:
    title = "RL step (generate + train), s/step, lower is better"
    data = rows("rl_step")
    if not data:
        return empty(ax, title, "rl_step")
    configs = sorted({r["config"] for r in data}, key=["tiny", "smollm2"].index)
    step = {(r["config"], r["framework"]): r["s_per_step"] for r in data}
    labels = [f"{c}\n{next(r['shape'] for r in data if r['config'] == c)}" for c in configs]
    bars(
        ax,
        labels,
        [
            ("mileage", [step[c, "mileage"] for c in configs], MILEAGE),
            ("TRL GRPOTrainer", [step[c, "trl"] for c in configs], BASELINE),
        ],
        "seconds per step",
    )
    ax.set_yscale("log")
    ax.set_title(title)


def generation(ax) -> None:
    title = "generation, 64 new tokens, tokens/s, higher is better"
    data = rows("generation")
    if not data:
        return empty(ax, title, "generation")
    labels = [f"{r['model'].split('-')[0]} {r['dtype']}\nbatch {r['batch']}" for r in data]
    bars(
        ax,
        labels,
        [
            ("mileage engine", [r["mileage_tok_s"] for r in data], MILEAGE),
            ("transformers generate", [r["transformers_tok_s"] for r in data], BASELINE),
        ],
        "tokens / s",
    )
    ax.set_yscale("log")
    ax.set_title(title)


def checkpoint(ax) -> None:
    title = "SmolLM2-135M training state: GB/s, higher is better"
    data = rows("checkpoint_smollm2")
    if not data:
        return empty(ax, title, "checkpoint_smollm2")
    by_op = {r["op"]: r for r in data}

    def speed(prefix: str) -> float:
        match = [r for op, r in by_op.items() if op.startswith(prefix)]
        return match[0]["gb_s"] if match else 0.0

    bars(
        ax,
        ["write", "read"],
        [
            ("raw disk (dd)", [speed("raw write"), speed("raw read")], RAW),
            ("mileage save / load", [speed("mileage save (sync"), speed("mileage load")], MILEAGE),
            ("torch.save / torch.load", [speed("torch.save"), speed("torch.load")], BASELINE),
        ],
        "GB / s",
    )
    ax.set_title(title)


def resume(ax) -> None:
    title = "launch to first new rollout, s, lower is better"
    labels, fresh, resumed = [], [], []
    for name in ("resume_tiny", "resume_smollm2"):
        data = {r["run"]: r for r in rows(name)}
        if "fresh plain" in data and "resume plain" in data:
            labels.append(name.split("_", 1)[1])
            fresh.append(data["fresh plain"]["s"])
            resumed.append(data["resume plain"]["s"])
    if not labels:
        return empty(ax, title, "resume_tiny")
    bars(ax, labels, [("fresh start", fresh, BASELINE), ("resume", resumed, MILEAGE)], "seconds")
    ax.set_title(title)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for draw, ax in zip((rl_step, generation, checkpoint, resume), axes.flat, strict=True):
        draw(ax)
        ax.title.set_fontsize(10)
    fig.suptitle("mileage vs the baselines, same machine, same run (bench/results/*.json)")
    fig.tight_layout()
    OUT.parent.mkdir(exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
