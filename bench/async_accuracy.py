"""Benchmark: held-out accuracy against wall-clock time, `mileage train` (sync) against
`mileage train-async` (one-step-off), on the built-in task. Draws docs/async.png.

Both runs train the same prompts in the same order from the same weights and evaluate the
held-out set every `--eval-interval` rollouts (and before training). The x axis is training
time: the sum of the rollouts' step_time up to that point (generation, training and the weight
sync; overlapped in the async run). Evaluation and the final save are measurement, not training,
and are left out of both runs alike. Sync gives each phase both cores (`--num-threads 2`);
one-step-off gives generation one core and training the other (`--num-threads 1` each), so on 2
cores async only wins where overlap gains more than halving each phase's threads loses
(bench/async.py measures that bound). On a GPU the phases run on separate devices and overlap
is the whole gain.

    python bench/async_accuracy.py                  # docs/async.png, bench/results/async_accuracy.json
    python bench/async_accuracy.py --num-rollout 60 --eval-interval 5 --png /tmp/a.png
    python bench/async_accuracy.py --engine serve --png docs/async_serve.png --out async_accuracy_serve

With `--engine serve` each run trains against its own fresh `mileage serve` pinned to core 0 and
the trainer is pinned to core 1, one thread each, in both runs: the engine and the trainer on
separate processors, as on a GPU machine, where sync pays G + T per rollout and one-step-off
max(G, T) (bench/async.py --engine serve measures both).

Run it on an idle machine: on a shared one the times are void (DEVELOPERS.md, "Measuring").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    REPO,
    load_average,
    machine_info,
    output_path,
    pinned_server,
    served_model,
    write_results,
)

RUNS = {  # name: (subcommand, torch threads)
    "sync (train, 2 threads per phase)": ("train", 2),
    "one-step-off (train-async, 1 thread per phase)": ("train-async", 1),
}
SERVE_RUNS = {  # the server on core 0, the trainer on core 1, one thread each
    "sync (train, server on core 0, trainer on core 1)": ("train", 1),
    "one-step-off (train-async, same cores)": ("train-async", 1),
}


def run(
    subcommand: str,
    args: list[str],
    threads: int,
    save: Path,
    served: str | None = None,
    pin: str | None = None,
) -> list[dict]:
    """One fresh `mileage` process; its metrics records (the evaluation before training first).
    `served`: train against a fresh `mileage serve` of that model on core 0, pinned to core 1."""
    if served is not None:
        with pinned_server(served, "0") as url:
            return run(subcommand, [*args, *url], threads, save, pin="1")
    command = [sys.executable, "-m", "mileage", subcommand, *args]
    command += ["--num-threads", str(threads), "--save", str(save)]
    if pin is not None:
        command = ["taskset", "-c", pin, *command]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def accuracy_curve(records: list[dict]) -> list[tuple[float, float, int]]:
    """(training seconds so far, held-out accuracy, rollout id) at every evaluation."""
    elapsed, curve = 0.0, []
    for record in records:
        elapsed += record.get("step_time", 0.0)  # the evaluation before training: none
        if "eval_accuracy" in record:
            curve.append((elapsed, record["eval_accuracy"], record["rollout_id"]))
    return curve


def time_to_reach(curve: list[tuple[float, float, int]], target: float) -> float | None:
    return next((t for t, acc, _ in curve if acc >= target), None)


def draw(curves: dict[str, list], title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, curve in curves.items():
        ax.plot([t for t, _, _ in curve], [a for _, a, _ in curve], marker="o", label=name)
    ax.set_xlabel("training wall-clock (s): sum of step_time (evaluation left out)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "async.png")
    parser.add_argument("--out", default="async_accuracy", help="bench/results/<OUT>.json")
    parser.add_argument("--note", default="", help="a line for the plot's title")
    parser.add_argument(
        "--engine",
        choices=("local", "serve"),
        default="local",
        help="serve: each run against a `mileage serve` on core 0, the trainer on core 1",
    )
    options, extra = parser.parse_known_args(argv)
    out = output_path(options.out)  # before measuring, not after
    if not options.png.parent.is_dir():
        parser.error(f"--png {options.png}: its directory does not exist")
    base = ["--num-rollout", str(options.num_rollout), "--eval-interval"]
    base += [str(options.eval_interval), *extra]
    served = served_model(extra) if options.engine == "serve" else None
    runs = RUNS if served is None else SERVE_RUNS
    load_before = load_average()
    curves, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-async-acc-") as tmp:
        for index, (name, (subcommand, threads)) in enumerate(runs.items()):
            records = run(subcommand, base, threads, Path(tmp) / str(index), served)
            curves[name] = accuracy_curve(records)
    sync_name, async_name = list(runs)
    sync_final = curves[sync_name][-1][1]
    for name, curve in curves.items():
        reached = time_to_reach(curve, sync_final)
        rows.append(
            {
                "run": name,
                "final_accuracy": curve[-1][1],
                "training_s": curve[-1][0],
                "s_to_sync_final_accuracy": reached,
            }
        )
        shown = "never" if reached is None else f"{reached:.1f}s"
        print(
            f"{name}: final held-out accuracy {curve[-1][1]:.3f} after {curve[-1][0]:.1f}s of "
            f"training; reaches sync's final {sync_final:.3f} at {shown}"
        )
    load_after = load_average()
    machine = machine_info(1)
    cpu = machine.get("cpu", {}).get("model", "") if isinstance(machine.get("cpu"), dict) else ""
    title = (
        f"built-in addition task, {options.num_rollout} rollouts, engine {options.engine}; {cpu} "
        f"load {load_before} -> {load_after}"
    )
    draw(curves, f"{title}\n{options.note}".strip(), options.png)
    print(f"wrote {options.png}")
    write_results(
        out,
        {
            "machine": machine,
            "load": [load_before, load_after],
            "args": base,
            "engine": options.engine,
            "curves": curves,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
