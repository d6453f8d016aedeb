"""The RL step through colocated vLLM (`--colocate`) against the step through a launched vLLM
server (today's `--rollout-engine vllm`), the same run side by side, and whether the two runs end
on the same tensors.

Needs an interpreter with vLLM and mileage (see bench/colocate_sync.py), run with it:

    VENV/bin/python bench/colocate_step.py --hf "$(mileage smollm2)" [--rollouts 4] [--out F.json]

Both runs: `mileage train` on arithmetic prompts written by this script (reward: `--rm-type
math`), 4 prompts x 4 samples, up to 32 new tokens, fp32, 2 threads, one optimizer step per
rollout; the server run launches `vllm serve` from this interpreter. From each run's
metrics.jsonl, rollout 0 left out (start-up): medians of the step's wall time and of its
generate, weight-sync and train parts. Then `compare_runs` on the two save directories.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import cpu_description

KEYS = ("step_time", "gen_time", "sync_time", "train_time")


def prompts(path: Path, count: int = 64) -> None:
    with path.open("w") as f:
        for i in range(count):
            a, b = 3 + (i * 7) % 50, 5 + (i * 11) % 40
            f.write(json.dumps({"question": f"What is {a} + {b}? Answer:", "answer": str(a + b)}))
            f.write("\n")


def run(args, data: Path, save: Path, engine: list[str]) -> list[dict]:
    command = [
        sys.executable, "-m", "mileage", "train",
        "--hf-checkpoint", args.hf,
        "--prompt-data", str(data), "--input-key", "question", "--label-key", "answer",
        "--rm-type", "math",
        "--num-rollout", str(args.rollouts),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "16", "--rollout-max-response-len", "32",
        "--lr", "1e-5", "--eval-interval", "0", "--precision", "fp32",
        "--num-threads", "2",
        "--rollout-engine", "vllm", *engine,
        "--save", str(save),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(engine) or 'server'} run failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def medians(records: list[dict]) -> dict[str, float]:
    later = [r for r in records if r.get("rollout_id", -1) >= 1]
    return {k: statistics.median(r[k] for r in later) for k in KEYS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import vllm

    from mileage.testing.compare import compare_runs

    root = Path(tempfile.mkdtemp(prefix="colocate-step-"))
    data = root / "prompts.jsonl"
    prompts(data)
    server = run(args, data, root / "server", ["--vllm-python", sys.executable])
    colocated = run(args, data, root / "colocated", ["--colocate"])
    m_server, m_colocated = medians(server), medians(colocated)
    diffs = compare_runs(root / "server", root / "colocated")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
    ).stdout.strip()
    result = {
        "cpu": cpu_description(),
        "commit": head,
        "vllm": vllm.__version__,
        "model": args.hf,
        "rollouts": args.rollouts,
        "server": m_server,
        "colocated": m_colocated,
        "colocated_over_server": {k: m_colocated[k] / m_server[k] for k in KEYS},
        "same_tensors_and_metrics": diffs == [],
        "differences": diffs[:20],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
