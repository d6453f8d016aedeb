"""LoRA against full fine-tuning: checkpoint size, step time, weight-sync time and peak RSS.

Each mode is one `mileage train` child process (same flags, same prompts) that saves its last
rollout; it reports:
    checkpoint   bytes of the final iter_N directory (model + optimizer + RNG + state + meta)
    step / train / sync  median over the rollouts after the first (metrics.jsonl's step_time,
                 train_time, sync_time; with the in-process engine sync is a no-op for both)
    peak RSS     the child's peak resident memory (wait4), model build and save included

    python bench/lora.py                                # built-in 3.2M model, a minute
    python bench/lora.py --model "$(mileage smollm2)"   # SmolLM2-135M-Instruct
    python bench/lora.py --rank 16 --rollouts 6 --target-modules all-linear
    python bench/lora.py --engine serve   # weight sync to a `mileage serve` on this machine

With `--engine serve` each mode trains against its own `mileage serve --dtype float32` server
(`--rollout-engine sglang`) and the sync column is the remote weight sync: full weights for
`full`, merged weights for `lora-merged` (a server without --enable-lora), the adapter alone
from a directory for `lora-adapter` and inside the request for `lora-tensor`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as common
from _common import median, spread

MODES = ("full", "lora")
SERVE_MODES = ("full", "lora-merged", "lora-adapter", "lora-tensor")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def train_args(model: str, rollouts: int, threads: int) -> list[str]:
    args = [
        "--num-rollout", str(rollouts),
        "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8",
        "--eval-interval", "0",
        "--num-threads", str(threads),
        "--lr", "1e-4",
    ]  # fmt: skip
    if model != "tiny":
        args += ["--hf-checkpoint", model]  # the built-in addition prompts, its tokenizer
    return args


def run_mode(
    mode: str, base_args: list[str], lora_args: list[str], work: Path, served: str | None = None
) -> dict:
    """One training child; `served`: the HF directory a `mileage serve` for it serves."""
    save = work / mode
    cmd = [sys.executable, "-m", "mileage", "train", *base_args, "--save", str(save)]
    if mode != "full":
        cmd += lora_args
    if mode == "lora-tensor":
        cmd += ["--lora-sync-from-tensor"]
    env = {**os.environ, "PYTHONPATH": str(common.REPO), "OMP_NUM_THREADS": "1"}
    server = None
    if served is not None:
        from mileage.testing.servers import start_servers

        flags = (
            "--dtype",
            "float32",
            *(() if mode in ("full", "lora-merged") else ("--enable-lora",)),
        )
        (server,) = start_servers(served, 1, env=env, args=flags)
        cmd += ["--rollout-engine", "sglang", "--rollout-url", server.url, "--precision", "fp32"]
    started = time.perf_counter()
    try:
        child = subprocess.Popen(cmd, cwd=common.REPO, env=env, stdout=subprocess.PIPE, text=True)
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
    finally:
        if server is not None:
            server.stop()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{mode}: mileage train exited {child.returncode}\n{out[-2000:]}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    last = max(p for p in save.iterdir() if p.name.startswith("iter_"))
    later = records[1:] or records
    return {
        "mode": mode,
        "checkpoint_mb": tree_bytes(last) / 1e6,
        "step_s": median([r["step_time"] for r in later]),
        "step_spread": spread([r["step_time"] for r in later]),
        "train_s": median([r["train_time"] for r in later]),
        "sync_s": median([r["sync_time"] for r in later]),
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (built-in) or an HF directory")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--target-modules", default="all-linear")
    parser.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    parser.add_argument("--engine", choices=("local", "serve"), default="local")
    parser.add_argument("--keep", help="run in this directory and keep the runs' saves")
    parser.add_argument("--out", default="lora")
    args = parser.parse_args()
    out = common.output_path(args.out)
    base = train_args(args.model, args.rollouts, args.threads)
    lora = [
        "--lora-rank", str(args.rank),
        "--lora-alpha", str(args.alpha),
        "--target-modules", args.target_modules,
    ]  # fmt: skip
    before = common.load_average()
    served = None
    if args.engine == "serve":
        from mileage.rollout.builtin_model import ensure_builtin_model

        served = args.model if args.model != "tiny" else str(ensure_builtin_model("addition"))
    modes = SERVE_MODES if served else MODES
    with tempfile.TemporaryDirectory(prefix="mileage-bench-lora-") as scratch:
        work = Path(args.keep) if args.keep else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        rows = [run_mode(mode, base, lora, work, served) for mode in modes]
    full, adapter = rows[0], rows[-1]
    ratio = adapter["checkpoint_mb"] / full["checkpoint_mb"]
    common.print_table(
        rows,
        [
            ("mode", "mode"),
            ("checkpoint_mb", "checkpoint MB"),
            ("step_s", "step s (median)"),
            ("step_spread", "step s (min-max)"),
            ("train_s", "train s"),
            ("sync_s", "sync s"),
            ("peak_rss_mb", "peak RSS MB"),
        ],
    )
    print(f"LoRA checkpoint = {100 * ratio:.2f}% of the full one")
    common.write_results(
        out,
        {
            "benchmark": "lora",
            "model": args.model,
            "engine": args.engine,
            "flags": {"base": base, "lora": lora},
            "rows": rows,
            "lora_checkpoint_fraction": ratio,
            "machine": common.machine_info(args.threads),
            "load_average": {"before": before, "after": common.load_average()},
        },
    )


if __name__ == "__main__":
    main()
