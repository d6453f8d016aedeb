"""Benchmark: rollouts per second of `mileage train` (sync) against `mileage train-async`
(one-step-off, and fully async), and how close the async step comes to perfect overlap.

On 2 cores, sync runs each phase on both cores while async gives each phase one core (the
generation thread and the trainer each run torch with one thread). The bound overlap can reach
is max(G1, T1): generation alone on one core (G1) and training alone on one core (T1), measured
here from a sync run pinned with `taskset -c 0` (G1: its gen_time) and one pinned with
`taskset -c 1` (T1: its train_time + sync_time). Target: async period <= 1.1 x max(G1, T1).
Also reported: the ratio sync period / async period (on GPUs, with separate devices, the
headline gain) and the measured staleness (mean over rollouts of staleness_mean).

The period of a run is its median per-rollout step_time after `--warmup` rollouts (process
start-up and the first rollouts are not timed). Every run is a fresh process.

    python bench/async.py                                   # built-in model
    python bench/async.py --hf-checkpoint "$(mileage smollm2)" --rollout-max-response-len 32
    python bench/async.py --rollout-engine sglang --rollout-url http://127.0.0.1:30000 ...

Run it on an idle machine: on a shared one the numbers are void (DEVELOPERS.md, "Measuring").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    REPO,
    load_average,
    machine_info,
    median,
    output_path,
    print_table,
    write_results,
)

MODES = {
    "sync": ("train", []),
    "one-step-off": ("train-async", []),
    "fully-async": ("train-async", ["--fully-async", "--max-weight-staleness", "2"]),
}


def run(subcommand: str, args: list[str], cores: str, threads: int, workdir: Path) -> list[dict]:
    """One fresh `mileage` process pinned to `cores`; its metrics records."""
    save = Path(tempfile.mkdtemp(dir=workdir))
    command = ["taskset", "-c", cores, sys.executable, "-m", "mileage", subcommand, *args]
    command += ["--num-threads", str(threads), "--save", str(save)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
    lines = (save / "metrics.jsonl").read_text().splitlines()
    shutil.rmtree(save, ignore_errors=True)
    return [json.loads(line) for line in lines if line.strip()]


def period(records: list[dict], warmup: int) -> float:
    """Median seconds per rollout: step_time spans a whole iteration of either driver (from
    taking the prompts to the engine holding the new weights; saves are at the end only)."""
    return median([r["step_time"] for r in records[warmup:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="also write bench/results/<OUT>.json")
    options, extra = parser.parse_known_args(argv)
    out = output_path(options.out) if options.out else None  # before measuring, not after
    base = ["--num-rollout", str(options.num_rollout), "--eval-interval", "0", *extra]
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        workdir = Path(tmp)
        # G1 and T1: each phase alone on one core, one torch thread
        gen_alone = run("train", base, "0", 1, workdir)
        train_alone = run("train", base, "1", 1, workdir)
        g1 = median([r["gen_time"] for r in gen_alone[options.warmup :]])
        t1 = median([r["train_time"] + r["sync_time"] for r in train_alone[options.warmup :]])
        rows = []
        for name, (subcommand, flags) in MODES.items():
            threads = 2 if name == "sync" else 1  # sync: both cores per phase
            records = run(subcommand, [*base, *flags], "0,1", threads, workdir)
            step = period(records, options.warmup)
            stale = [r.get("staleness_mean", 0.0) for r in records[options.warmup :]]
            rows.append(
                {
                    "mode": name,
                    "period_s": step,
                    "rollouts_per_s": 1.0 / step,
                    "vs_bound": step / max(g1, t1),
                    "staleness": sum(stale) / len(stale),
                }
            )
    sync_period = rows[0]["period_s"]
    for row in rows:
        row["speedup_vs_sync"] = sync_period / row["period_s"]
    print(f"G1 (generation, 1 core) {g1:.3f}s, T1 (training, 1 core) {t1:.3f}s")
    print_table(
        rows,
        [
            ("mode", "mode"),
            ("period_s", "s / rollout"),
            ("rollouts_per_s", "rollouts/s"),
            ("vs_bound", "period / max(G1,T1)"),
            ("speedup_vs_sync", "sync / period"),
            ("staleness", "staleness"),
        ],
    )
    if out is not None:
        write_results(
            out,
            {
                "machine": machine_info(1),
                "load": [load_before, load_average()],
                "args": base,
                "g1_s": g1,
                "t1_s": t1,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
