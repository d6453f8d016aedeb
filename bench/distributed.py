"""Benchmark 5: one process against torchrun with 2 (FSDP2, gloo on CPU): step time, peak RSS
per rank, checkpoint save and load time.

For each model and world size N in (1, 2), in one invocation and alternating N:
  1. `torchrun --nproc-per-node N -m mileage train ... --save D --save-interval 1` for
     `--rollouts` rollouts: per-rollout `gen_time`, `train_time` and `step_time` from
     metrics.jsonl (the first rollout is warm-up and not counted), each rank's peak RSS, and the
     seconds each rank spends in `CheckpointWriter.save` (write + commit, sync saves);
  2. the same command with one more rollout, which resumes from D: the seconds each rank spends
     in `restore` (reading and loading model, optimizer, RNG and trainer state).
Every rank runs through `bench/_rank_probe.py`, which wraps those two functions and writes its
numbers to a JSON file at exit, with the phase of the run (load, build, generate, train, ...)
in which its resident set reached its peak. Each rank gets one thread (`--num-threads 1`), so
N=2 uses the machine's two cores and N=1 one of them.

With `--engine remote` the trainers generate through one `mileage serve` server started here
(`--rollout-engine sglang`, weights synced through the disk); the server's own memory is not
counted, only the trainer ranks'.

    python bench/distributed.py                                  # built-in model
    python bench/distributed.py --smollm2-dir "$(mileage smollm2)"
    python bench/distributed.py --smollm2-dir "$(mileage smollm2)" --models smollm2 --engine remote
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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

PROBE = Path(__file__).resolve().parent / "_rank_probe.py"

SHAPES = {
    # built-in model: the crash harness's run (two optimizer steps per rollout)
    "tiny": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
             "--global-batch-size", "16", "--rollout-max-response-len", "8"],
    # SmolLM2-135M: 4 prompts x 4 samples, one optimizer step per rollout
    "smollm2": ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                "--global-batch-size", "16", "--rollout-max-response-len", "16"],
}  # fmt: skip


def launch(
    model: str, hf_dir: str | None, nproc: int, rollouts: int, save: Path, out: Path, url=None
):
    args = [*SHAPES[model], "--num-rollout", str(rollouts), "--eval-interval", "0"]
    if url:
        args += ["--rollout-engine", "sglang", "--rollout-url", url]
    args += ["--num-threads", "1", "--save", str(save), "--load", str(save), "--save-interval", "1"]
    if hf_dir:
        args += ["--hf-checkpoint", hf_dir]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--standalone", str(PROBE), str(out), "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"launch failed ({model}, N={nproc}):\n{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def peak_phase(rank: dict) -> str:
    """The phase after which this rank's high-water mark first reached its final value."""
    phases = rank.get("phases", [])
    top = max((p.get("VmHWM", 0) for p in phases), default=0)
    return next((p["phase"] for p in phases if p.get("VmHWM", 0) == top), "?")


def measure(
    model: str,
    hf_dir: str | None,
    nproc: int,
    rollouts: int,
    work: Path,
    url: str | None = None,
    skip_resume: bool = False,
) -> dict:
    save = work / f"{model}_n{nproc}"
    shutil.rmtree(save, ignore_errors=True)
    train_probe, resume_probe = work / f"{save.name}_train", work / f"{save.name}_resume"
    for d in (train_probe, resume_probe):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    ranks = launch(model, hf_dir, nproc, rollouts, save, train_probe, url)
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:]  # the first rollout warms up allocators and caches
    resumed = (
        [] if skip_resume else launch(model, hf_dir, nproc, rollouts + 1, save, resume_probe, url)
    )
    return {
        "model": model,
        "nproc": nproc,
        "step_s": median([r["step_time"] for r in timed]),
        "gen_s": median([r["gen_time"] for r in timed]),
        "train_s": median([r["train_time"] for r in timed]),
        "engine": "remote" if url else "local",
        "rss_gib": [round(r["max_rss_kib"] / 2**20, 2) for r in ranks],
        "peak_in": [peak_phase(r) for r in ranks],
        "phases": [r.get("phases", []) for r in ranks],
        "save_s": median([s for r in ranks[:1] for s in r["save_s"][1:]]),
        "load_s": max((r["restore_s"][0] for r in resumed), default=None),
        "ckpt_mb": round(
            sum(p.stat().st_size for p in (save / "iter_0000000").rglob("*") if p.is_file()) / 1e6,
            1,
        ),
    }


@contextlib.contextmanager
def serving(model: str, hf_dir: str | None, remote: bool) -> Iterator[str | None]:
    """The URL of a `mileage serve` for `model` while the block runs, or None (local engine)."""
    if not remote:
        yield None
        return
    from mileage.rollout.builtin_model import ensure_builtin_model
    from mileage.testing.servers import start_servers

    path = hf_dir or str(ensure_builtin_model("addition"))
    (server,) = start_servers(path, 1)
    try:
        yield server.url
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2-dir", help="also measure SmolLM2-135M (an HF directory)")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per run (1 is warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per model and N")
    parser.add_argument(
        "--models", default="tiny,smollm2", help="which of tiny,smollm2 (smollm2 needs its dir)"
    )
    parser.add_argument(
        "--engine",
        choices=("local", "remote"),
        default="local",
        help="local: the in-process engine; remote: one `mileage serve` server generates",
    )
    parser.add_argument("--nprocs", default="1,2", help="world sizes to measure, in order")
    parser.add_argument(
        "--skip-resume", action="store_true", help="no resume launch (no resume load time)"
    )
    parser.add_argument(
        "--out", help="results JSON (default bench/results/distributed[_remote].json)"
    )
    args = parser.parse_args()
    out = output_path(
        args.out or ("distributed" if args.engine == "local" else "distributed_remote")
    )
    wanted = args.models.split(",")
    models = [("tiny", None)] if "tiny" in wanted else []
    models += [("smollm2", args.smollm2_dir)] if args.smollm2_dir and "smollm2" in wanted else []
    before = load_average()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mileage_bench_dist_") as tmp:
        for model, hf_dir in models:
            with serving(model, hf_dir, args.engine == "remote") as url:
                for _ in range(args.repeats):
                    for nproc in map(int, args.nprocs.split(",")):
                        row = measure(
                            model, hf_dir, nproc, args.rollouts, Path(tmp), url, args.skip_resume
                        )
                        print(json.dumps({k: v for k, v in row.items() if k != "phases"}))
                        sys.stdout.flush()
                        rows.append(row)
    for row in rows:
        row["rss_per_rank"] = " / ".join(f"{x:.2f}" for x in row["rss_gib"])
        row["peak_phase"] = " / ".join(row["peak_in"])
    table = print_table(
        rows,
        [
            ("model", "model"),
            ("nproc", "N"),
            ("step_s", "step s"),
            ("gen_s", "generate s"),
            ("train_s", "train s"),
            ("engine", "engine"),
            ("rss_per_rank", "peak RSS GiB per rank"),
            ("peak_phase", "peak reached in"),
            ("save_s", "save s"),
            ("load_s", "resume load s"),
            ("ckpt_mb", "checkpoint MB"),
        ],
    )
    write_results(
        out,
        {
            "machine": machine_info(1),
            "load_before": before,
            "load_after": load_average(),
            "rows": rows,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
