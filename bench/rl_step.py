"""Benchmark 1: seconds per RL step (generate + train) for `mileage train` and TRL's GRPOTrainer.

One step = sample G completions for each of P prompts, score them, and take one optimizer step
on them: GRPO advantages, no KL term, AdamW at lr 1e-4, grad-norm clip 1.0, constant LR,
temperature 1, top-p 1. Both start from the same weights:

    tiny      the built-in 3.2M-parameter model (`ensure_builtin_model("addition")`),
              16 prompts x 8 samples, at most 8 new tokens
    smollm2   SmolLM2-135M-Instruct (only with --smollm2-dir), 4 prompts x 4 samples,
              at most 32 new tokens

mileage runs as the real CLI (`python -m mileage train ... --save TMP`) and its per-rollout
`step_time` (generate + score + pack + train + weight hand-over) comes from metrics.jsonl. TRL
runs in a worker process of this script, with the GRPOConfig of the feasibility note (§3), and
its step time is on_step_begin -> on_step_end (generation happens inside the training step).
Every run is a fresh process, so peak RSS (from wait4) is per framework; runs alternate between
the frameworks, and the first `--warmup` steps of each run are not timed.

Each is run at every precision of `--precisions` (mileage's `--precision`, TRL's `bf16=`: both
bf16 autocast over fp32 weights), and the host's matmul limit per precision (`_common.
matmul_limits`) and bf16 CPU flags are recorded beside the times.

    python bench/rl_step.py
    python bench/rl_step.py --smollm2-dir "$(mileage smollm2)"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    DEFAULT_THREADS,
    REPO,
    load_average,
    machine_info,
    matmul_limits,
    median,
    output_path,
    print_table,
    spread,
    write_results,
)

CONFIGS = {
    # prompts, samples per prompt, max new tokens, timed steps, warm-up steps, runs per framework
    "tiny": {"prompts": 16, "samples": 8, "max_new": 8, "steps": 20, "warmup": 3, "runs": 2},
    "smollm2": {"prompts": 4, "samples": 4, "max_new": 32, "steps": 3, "warmup": 1, "runs": 2},
}
LR = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument(
        "--smollm2-dir", default=None, help="converted SmolLM2 HF dir (adds that config)"
    )
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (per config)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps per run")
    p.add_argument("--runs", type=int, default=None, help="runs per framework (alternating)")
    p.add_argument(
        "--frameworks",
        default="mileage,trl",
        help="comma-separated: mileage (local engine), mileage-vllm (needs --vllm-python), trl",
    )
    p.add_argument("--vllm-python", help="Python of a vLLM venv (scripts/install_vllm.sh)")
    p.add_argument(
        "--mileage-args",
        default="",
        help='more flags for every mileage run, one string after "=" (e.g. --mileage-args='
        '"--gradient-checkpointing --micro-batch-size 4"); recorded with the results',
    )
    p.add_argument(
        "--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)"
    )
    p.add_argument(
        "--out",
        default="rl_step",
        help="results file: a bare NAME is bench/results/NAME.json, a path is used as given "
        "(.json added when missing)",
    )
    # internal: one TRL run in this process, results written as JSON to --worker-out
    p.add_argument("--worker", choices=("trl",), help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-model", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--worker-precision", default="fp32", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[int, float, float, str]:
    """Run `cmd`; returns (exit code, wall seconds, peak RSS in MiB of that process, output)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    return proc.returncode, time.perf_counter() - started, usage.ru_maxrss / 1024, output


# --------------------------------------------------------------------------------------------
# mileage: the real CLI


def mileage_run(
    config: dict,
    model_dir: str | None,
    threads: int,
    vllm_python: str | None = None,
    precision: str = "fp32",
    extra: tuple[str, ...] = (),
) -> dict:
    total = config["warmup"] + config["steps"]
    with tempfile.TemporaryDirectory(prefix="bench-mileage-") as save:
        cmd = [
            sys.executable, "-m", "mileage", "train",
            "--save", save,
            "--num-rollout", str(total),
            "--rollout-batch-size", str(config["prompts"]),
            "--n-samples-per-prompt", str(config["samples"]),
            "--rollout-max-response-len", str(config["max_new"]),
            "--rollout-temperature", "1.0",
            "--rollout-top-p", "1.0",
            "--lr", str(LR),
            "--clip-grad", "1.0",
            "--eval-interval", "0",
            "--num-threads", str(threads),
            "--precision", precision,
        ]  # fmt: skip
        if model_dir:
            cmd += ["--hf-checkpoint", model_dir]
        if vllm_python:  # mileage launches vLLM (its start-up is outside every step's time)
            cmd += ["--rollout-engine", "vllm", "--vllm-python", vllm_python]
        cmd += extra
        code, wall, rss, output = run_measured(cmd)
        if code != 0:
            raise RuntimeError(f"mileage train failed ({code}):\n{output[-3000:]}")
        records = [
            json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()
        ]
    timed = records[config["warmup"] :]
    return {
        "framework": "mileage-vllm" if vllm_python else "mileage",
        "precision": precision,
        "step_s": [r["step_time"] for r in timed],
        "gen_s": [r["gen_time"] for r in timed],
        "train_s": [r["train_time"] for r in timed],
        "sync_s": [r["sync_time"] for r in timed],
        "reward": [r["reward_mean"] for r in records],
        "completion_len": [r["response_len"] for r in timed],
        "process_wall_s": wall,
        "peak_rss_mib": rss,
    }


# --------------------------------------------------------------------------------------------
# TRL: GRPOTrainer in a worker process (config of research note feasibility-cpu.md §3)


def trl_run(
    config_name: str, config: dict, model_dir: str, threads: int, precision: str = "fp32"
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, str(Path(__file__).resolve()),
            "--worker", "trl",
            "--worker-config", json.dumps({**config, "name": config_name}),
            "--worker-model", model_dir,
            "--worker-out", str(out),
            "--threads", str(threads),
            "--worker-precision", precision,
        ]  # fmt: skip
        code, wall, rss, output = run_measured(cmd, env={"TOKENIZERS_PARALLELISM": "false"})
        if code != 0 or not out.is_file():
            raise RuntimeError(f"TRL worker failed ({code}):\n{output[-3000:]}")
        result = json.loads(out.read_text())
    return {
        **result,
        "framework": "trl",
        "precision": precision,
        "process_wall_s": wall,
        "peak_rss_mib": rss,
    }


def trl_worker(args: argparse.Namespace) -> int:
    import torch

    import mileage.models.hf  # noqa: F401  (offline, quiet transformers)
    from mileage.rollout.tasks import builtin_task

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = json.loads(args.worker_config)
    p, g, total = config["prompts"], config["samples"], config["warmup"] + config["steps"]
    tokenizer = AutoTokenizer.from_pretrained(args.worker_model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.worker_model, dtype=torch.float32)
    # TRL tokenizes prompts without special tokens; mileage's built-in tokenizer adds <bos>
    # itself, so spell it out to give both frameworks the same prompt ids
    prefix = tokenizer.bos_token if config["name"] == "tiny" else ""
    rows = [
        {"prompt": prefix + r["prompt"], "answer": r["label"]} for r in builtin_task("addition")[0]
    ]

    def reward_exact(completions, answer, **_):
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_s, self.begin, self.threads, self.logs = [], None, [], []

        def on_step_begin(self, *_, **__):
            self.begin = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.step_s.append(time.perf_counter() - self.begin)
            self.threads.append(torch.get_num_threads())

        def on_log(self, _args, _state, _control, logs=None, **__):
            self.logs.append(dict(logs or {}))

    with tempfile.TemporaryDirectory(prefix="trl-out-") as out_dir:
        cfg = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=args.worker_precision == "bf16",  # accelerate's bf16 autocast, fp32 weights
            per_device_train_batch_size=p * g,
            num_generations=g,
            steps_per_generation=1,
            max_completion_length=config["max_new"],
            learning_rate=LR,
            beta=0.0,
            max_steps=total,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            temperature=1.0,
            top_p=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            disable_tqdm=True,
            seed=1234,
        )
        timer = Timer()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_exact,
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        torch.set_num_threads(args.threads)  # in case accelerate changed it
        trainer.train()
    logs = [entry for entry in timer.logs if "reward" in entry]
    result = {
        "step_s": timer.step_s[config["warmup"] :],
        "reward": [entry["reward"] for entry in logs],
        "completion_len": [
            entry.get("completions/mean_length") for entry in logs[config["warmup"] :]
        ],
        "threads_seen": sorted(set(timer.threads)),
        "loss_type": cfg.loss_type,
        "scale_rewards": cfg.scale_rewards,
    }
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------------------------


def summarize(name: str, runs: list[dict], config: dict) -> dict:
    steps = [s for r in runs for s in r["step_s"]]
    lens = [x for r in runs for x in r.get("completion_len", []) if x is not None]
    row = {
        "config": name,
        "shape": f"{config['prompts']}x{config['samples']}x{config['max_new']}",
        "framework": runs[0]["framework"],
        "precision": runs[0]["precision"],
        "s_per_step": median(steps),
        "s_range": spread(steps),
        "run_medians": [round(median(r["step_s"]), 4) for r in runs],
        "steps_timed": len(steps),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "completion_len": median(lens) if lens else None,
    }
    if "gen_s" in runs[0]:
        row["gen_s"] = median([s for r in runs for s in r["gen_s"]])
        row["train_s"] = median([s for r in runs for s in r["train_s"]])
        row["sync_s"] = median([s for r in runs for s in r["sync_s"]])
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "trl":
        return trl_worker(args)

    out = output_path(args.out)  # before a minute of measuring, not after it
    from mileage.rollout.builtin_model import ensure_builtin_model

    frameworks = args.frameworks.split(",")
    plans = []
    if not args.skip_tiny:
        plans.append(("tiny", dict(CONFIGS["tiny"]), None))
    if args.smollm2_dir:
        plans.append(("smollm2", dict(CONFIGS["smollm2"]), args.smollm2_dir))
    info = machine_info(args.threads)
    info["matmul_gflops"] = matmul_limits(args.threads)
    print(f"machine: {info['cpu']}, {args.threads} torch threads, load {load_average()}")
    print(f"matmul limit (GFLOP/s by size): {info['matmul_gflops']}")
    precisions = args.precisions.split(",")
    rows, raw = [], {}
    for name, config, model_dir in plans:
        for key in ("steps", "warmup", "runs"):
            if getattr(args, key) is not None:
                config[key] = getattr(args, key)
        # both frameworks load the same directory; the built-in one is built here if needed
        hf_dir = model_dir or str(ensure_builtin_model("addition"))
        # (framework, precision) pairs, alternating order between runs
        pairs = [(fw, prec) for prec in precisions for fw in frameworks]
        results = {pair: [] for pair in pairs}
        loads = []
        for run in range(config["runs"]):
            order = pairs if run % 2 == 0 else list(reversed(pairs))
            for fw, prec in order:
                loads.append(load_average())
                if fw in ("mileage", "mileage-vllm"):
                    vllm = args.vllm_python if fw == "mileage-vllm" else None
                    extra = tuple(shlex.split(args.mileage_args))
                    result = mileage_run(config, model_dir, args.threads, vllm, prec, extra)
                else:
                    result = trl_run(name, config, hf_dir, args.threads, prec)
                results[(fw, prec)].append(result)
                print(
                    f"  {name} run {run} {fw} {prec}: median {median(result['step_s']):.3f} "
                    f"s/step, peak RSS {result['peak_rss_mib']:.0f} MiB, load {load_average()}",
                    flush=True,
                )
        summary = {pair: summarize(name, results[pair], config) for pair in pairs}
        for (_, prec), row in summary.items():
            trl = summary.get(("trl", prec))  # TRL at the same precision
            if trl is not None:
                row["ratio_vs_trl"] = row["s_per_step"] / trl["s_per_step"]
                row["rss_vs_trl"] = row["peak_rss_mib"] / trl["peak_rss_mib"]
        rows += summary.values()
        raw[name] = {
            "config": config,
            "runs": {f"{fw} {prec}": r for (fw, prec), r in results.items()},
            "load_averages": loads,
        }
    table = print_table(
        rows,
        [
            ("config", "config"),
            ("shape", "P x G x len"),
            ("framework", "framework"),
            ("precision", "precision"),
            ("s_per_step", "s/step (median)"),
            ("s_range", "(range)"),
            ("ratio_vs_trl", "time vs TRL"),
            ("gen_s", "generate s"),
            ("train_s", "train s"),
            ("sync_s", "weight sync s"),
            ("completion_len", "completion len"),
            ("peak_rss_mib", "peak RSS MiB"),
            ("rss_vs_trl", "RSS vs TRL"),
        ],
    )
    write_results(
        out,
        {
            "benchmark": "rl_step",
            "machine": info,
            "settings": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
            "rows": rows,
            "raw": raw,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
