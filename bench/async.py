"""Benchmark: rollouts per second of `mileage train` (sync) against `mileage train-async`
(one-step-off, and fully async), and how close the async step comes to perfect overlap.

On 2 cores, sync runs each phase on both cores while async gives each phase one core (the
generation thread and the trainer each run torch with one thread). The bound overlap can reach
is max(G1, T1): generation alone on one core (G1) and training alone on one core (T1), measured
here from a sync run pinned with `taskset -c 0` (G1: its gen_time) and one pinned with
`taskset -c 1` (T1: its train_time + sync_time). Target: async period <= 1.1 x max(G1, T1).
An engine cannot generate while it loads new weights, so a second bound counts the weight sync
(S1, the sync_time within T1) on the engine's side too: max(G1 + S1, T1). The two agree where
the hand-over is free (the in-process engine) and part where it is not (a server loading from
disk). Also reported: the ratio sync period / async period (on GPUs, with separate devices, the
headline gain) and the measured staleness (mean over rollouts of staleness_mean).

The period of a run is its median per-rollout step_time after `--warmup` rollouts (process
start-up and the first rollouts are not timed). Every run is a fresh process.

    python bench/async.py                                   # built-in model
    python bench/async.py --hf-checkpoint "$(mileage smollm2)" --rollout-max-response-len 32
    python bench/async.py --rollout-engine sglang --rollout-url http://127.0.0.1:30000 ...

With `--engine serve` the engine is a `mileage serve` (the SGLang protocol) pinned to core 0 and
the trainer is pinned to core 1, one thread each, for every mode: the two phases then run on
separate processors, as on a GPU machine where the engine and the trainer have devices of their
own. Sync waits for each phase in turn (G + T per rollout); async overlaps them (max(G, T)). G1
and T1 are the sync run's own gen_time and train_time + sync_time, and each run gets a fresh
server (the weights it serves are those of the run's start).

    python bench/async.py --engine serve --out async_serve
    python bench/async.py --engine vllm --vllm-python /work/venvs/vllm/bin/python \
        --hf-checkpoint "$(mileage smollm2)" ...

`--engine vllm` is the same topology with a vLLM that mileage launches (`--rollout-engine vllm`):
its Python is wrapped so the server runs pinned to core 0 (`taskset`, and vLLM's CPU thread
binding `VLLM_CPU_OMP_THREADS_BIND=0`) while the trainer that launched it is pinned to core 1.
    python bench/async.py --engine serve --hf-checkpoint "$(mileage smollm2)" ...

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
    pinned_server,
    print_table,
    served_model,
    write_results,
)

MODES = {
    "sync": ("train", []),
    "one-step-off": ("train-async", []),
    "fully-async": ("train-async", ["--fully-async", "--max-weight-staleness", "2"]),
}


def run(
    subcommand: str,
    args: list[str],
    cores: str,
    threads: int,
    workdir: Path,
    served: str | None = None,
) -> list[dict]:
    """One fresh `mileage` process pinned to `cores`; its metrics records. `served`: the model
    a fresh `mileage serve` on core 0 serves to it."""
    if served is not None:
        with pinned_server(served, "0") as url:
            return run(subcommand, [*args, *url], cores, threads, workdir)
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


def pinned_python(python: str, core: str, workdir: Path) -> str:
    """A script that runs `python` pinned to `core`, for --vllm-python: the server mileage
    launches then runs there, whatever core the trainer is pinned to."""
    wrapper = workdir / "python-on-core"
    wrapper.write_text(
        f"#!/bin/sh\nexport VLLM_CPU_OMP_THREADS_BIND={core}\n"
        f'exec taskset -c {core} "{Path(python).absolute()}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def period(records: list[dict], warmup: int) -> float:
    """Median seconds per rollout: step_time spans a whole iteration of either driver (from
    taking the prompts to the engine holding the new weights; saves are at the end only)."""
    return median([r["step_time"] for r in records[warmup:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--engine",
        choices=("local", "serve", "vllm"),
        default="local",
        help="local: the in-process engine; serve / vllm: the engine on core 0, the trainer on 1",
    )
    parser.add_argument("--vllm-python", help="with --engine vllm: a vLLM venv's python")
    parser.add_argument("--out", help="also write bench/results/<OUT>.json")
    options, extra = parser.parse_known_args(argv)
    out = output_path(options.out) if options.out else None  # before measuring, not after
    base = ["--num-rollout", str(options.num_rollout), "--eval-interval", "0", *extra]
    served = served_model(extra) if options.engine == "serve" else None
    if options.engine == "vllm" and not options.vllm_python:
        parser.error("--engine vllm needs --vllm-python (scripts/install_vllm.sh)")
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        workdir = Path(tmp)
        rows, runs = [], {}
        if options.engine == "vllm":
            base += ["--rollout-engine", "vllm", "--vllm-python", pinned_python(
                options.vllm_python, "0", workdir)]  # fmt: skip
        separate = options.engine != "local"  # the engine on core 0, the trainer on core 1
        if not separate:
            # G1 and T1: each phase alone on one core, one torch thread
            gen_alone = run("train", base, "0", 1, workdir)
            train_alone = run("train", base, "1", 1, workdir)
        for name, (subcommand, flags) in MODES.items():
            if not separate:
                threads, cores = (2 if name == "sync" else 1), "0,1"  # sync: both cores per phase
            else:
                threads, cores = 1, "1"  # the engine has core 0
            records = run(subcommand, [*base, *flags], cores, threads, workdir, served)
            runs[name] = records
            step = period(records, options.warmup)
            stale = [r.get("staleness_mean", 0.0) for r in records[options.warmup :]]
            rows.append(
                {
                    "mode": name,
                    "period_s": step,
                    "rollouts_per_s": 1.0 / step,
                    "staleness": sum(stale) / len(stale),
                }
            )
    if separate:  # the phases on separate cores: the sync run measures each alone
        gen_alone = train_alone = runs["sync"]
    g1 = median([r["gen_time"] for r in gen_alone[options.warmup :]])
    t1 = median([r["train_time"] + r["sync_time"] for r in train_alone[options.warmup :]])
    s1 = median([r["sync_time"] for r in train_alone[options.warmup :]])
    for row in rows:
        row["vs_bound"] = row["period_s"] / max(g1, t1)
        # an engine that cannot generate while it loads new weights: G1 + S1 per rollout
        row["vs_engine_bound"] = row["period_s"] / max(g1 + s1, t1)
    sync_period = rows[0]["period_s"]
    for row in rows:
        row["speedup_vs_sync"] = sync_period / row["period_s"]
    print(
        f"G1 (generation, 1 core) {g1:.3f}s, T1 (training + weight sync, 1 core) {t1:.3f}s, "
        f"of which S1 (weight sync) {s1:.3f}s"
    )
    print_table(
        rows,
        [
            ("mode", "mode"),
            ("period_s", "s / rollout"),
            ("rollouts_per_s", "rollouts/s"),
            ("vs_bound", "period / max(G1,T1)"),
            ("vs_engine_bound", "period / max(G1+S1,T1)"),
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
                "engine": options.engine,
                "g1_s": g1,
                "t1_s": t1,
                "s1_s": s1,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
