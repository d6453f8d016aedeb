"""Peak memory and step time of the SmolLM2 RL step: the whole-batch path against the defaults.

Workloads (issue 40), SmolLM2-135M-Instruct, fp32, GRPO, mileage's defaults otherwise, on word
problems written by this script (chat template, graded by the math reward):

    64x128     8 prompts x 8 samples, at most 128 new tokens
    128x128    16 prompts x 8 samples, at most 128 new tokens
    16x1024    2 prompts x 8 samples, at most 1,024 new tokens

Arms, each a fresh `mileage train` process (2 rollouts; the second is the timed one):

    whole      the path before memory budgets: `--log-probs-chunk-size -1` and the rollout in one
               micro-batch (`--micro-batch-size` = every sample)
    defaults   no memory flag: log-probs in chunks, the micro-batch chosen from the budget
    checkpointed  the defaults with `--gradient-checkpointing` (the budget then fits more samples
               per micro-batch; not run unless named in --arms)

The peak RSS is the process's (wait4), so it covers generation, training and the weight
hand-over; `mem_peak_gib` and `mem_estimate_gib` of each rollout come from metrics.jsonl, and
the plan's estimate from its `memory:` line. A whole-batch arm that the preflight refuses
(it would not fit this machine) is reported with its one-line refusal instead of being run
into the kernel's OOM killer.

    python bench/memory.py --model-dir "$(mileage smollm2)"
    python bench/memory.py --model-dir "$(mileage smollm2)" --workloads 64x128 --arms defaults
    python bench/memory.py --model-dir "$(mileage smollm2)" --arms defaults,checkpointed
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from _common import DEFAULT_THREADS, machine_info, output_path, print_table, write_results
from checkpoint import output
from rl_step import run_measured

WORKLOADS = {"64x128": (8, 8, 128), "128x128": (16, 8, 128), "16x1024": (2, 8, 1024)}
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo")
ITEMS = ("apples", "stickers", "marbles", "books", "coins", "pencils", "shells", "cards")


def word_problems(path: Path, count: int = 32) -> Path:
    """`count` two-step word problems with their answers, as JSONL (question, answer)."""
    with path.open("w") as f:
        for i in range(count):
            name, item = NAMES[i % len(NAMES)], ITEMS[(i * 3) % len(ITEMS)]
            a, b, c = 3 + (i * 7) % 40, 2 + (i * 5) % 9, 1 + (i * 11) % 13
            question = (
                f"{name} has {a} {item}. {name} buys {b} bags with {c} {item} in each bag. "
                f"How many {item} does {name} have now? Explain your steps."
            )
            f.write(json.dumps({"question": question, "answer": str(a + b * c)}) + "\n")
    return path


def run_arm(model_dir: str, workload: str, arm: str, threads: int, data: Path) -> dict:
    prompts, samples, max_new = WORKLOADS[workload]
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as save:
        cmd = [
            sys.executable, "-m", "mileage", "train",
            "--hf-checkpoint", model_dir,
            "--prompt-data", str(data), "--input-key", "question", "--label-key", "answer",
            "--apply-chat-template", "--rm-type", "math",
            "--save", save, "--save-interval", "100",
            "--num-rollout", "2",
            "--rollout-batch-size", str(prompts),
            "--n-samples-per-prompt", str(samples),
            "--rollout-max-response-len", str(max_new),
            "--eval-interval", "0",
            "--num-threads", str(threads),
            "--precision", "fp32",
        ]  # fmt: skip
        if arm == "whole":
            cmd += ["--log-probs-chunk-size", "-1", "--micro-batch-size", str(prompts * samples)]
        elif arm == "checkpointed":
            cmd += ["--gradient-checkpointing"]
        code, wall, rss_mib, output = run_measured(cmd)
        metrics = Path(save) / "metrics.jsonl"
        records = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        )
    plan = re.search(r"memory: peak ~([\d.]+) GiB.*?micro-batch (\d+) samples", output)
    row = {
        "workload": workload,
        "arm": arm,
        "exit": code,
        "peak_rss_gib": round(rss_mib / 1024, 2),
        "plan_estimate_gib": float(plan.group(1)) if plan else None,
        "micro_batch": int(plan.group(2)) if plan else None,
        "process_wall_s": round(wall, 1),
    }
    if code != 0:
        row["refusal"] = output.strip().splitlines()[-1] if output.strip() else ""
        return row
    last = records[-1]
    row.update(
        step_s=round(last["step_time"], 1),
        gen_s=round(last["gen_time"], 1),
        train_s=round(last["train_time"], 1),
        response_len=round(last["response_len"], 1),
        mem_peak_gib=[r.get("mem_peak_gib") for r in records],
        mem_estimate_gib=[r.get("mem_estimate_gib") for r in records],
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", required=True, help="SmolLM2-135M-Instruct HF directory")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--arms", default="whole,defaults")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--out", default="memory", help="results: bench/results/NAME.json or a path")
    args = p.parse_args(argv)
    out = output_path(args.out)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = word_problems(Path(tmp) / "word_problems.jsonl")
        for workload in args.workloads.split(","):
            for arm in args.arms.split(","):
                rows.append(run_arm(args.model_dir, workload, arm, args.threads, data))
                print(json.dumps(rows[-1]), flush=True)
    print_table(
        rows,
        [
            ("workload", "workload"),
            ("arm", "arm"),
            ("micro_batch", "micro-batch"),
            ("peak_rss_gib", "peak RSS GiB"),
            ("plan_estimate_gib", "plan estimate GiB"),
            ("step_s", "step s"),
            ("train_s", "train s"),
            ("response_len", "response len"),
        ],
    )
    machine = machine_info(args.threads)
    dirty = " + uncommitted mileage/" if output("git", "status", "--porcelain", "mileage") else ""
    machine["code"] = output("git", "rev-parse", "--short", "HEAD") + dirty
    write_results(out, {"machine": machine, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
