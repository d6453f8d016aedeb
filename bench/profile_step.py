"""Where one RL step's time goes: the torch profiler around real `mileage train` rollouts.

Builds the run exactly as `mileage train` does (same flags, same components), runs a few
untimed rollouts, then profiles the next ones phase by phase: generate (sampling + scoring),
pack (samples -> padded tensors), train (forward, backward, clip, AdamW). Prints the wall time
of each phase and the operators with the most self CPU time, and writes both to
bench/results/profile_NAME.txt.

    python bench/profile_step.py --name tiny
    python bench/profile_step.py --name smollm2 --rollouts 2 -- \
        --hf-checkpoint "$(mileage smollm2)" --rollout-batch-size 4 --n-samples-per-prompt 4 \
        --rollout-max-response-len 32

Flags after `--` are `mileage train` flags; the defaults are the RL-step benchmark's tiny config.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

from _common import RESULTS, load_average, machine_info

TINY_STEP = [
    "--rollout-batch-size", "16",
    "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8",
    "--rollout-temperature", "1.0",
    "--lr", "1e-4",
    "--clip-grad", "1.0",
    "--eval-interval", "0",
]  # fmt: skip
PHASES = ("generate", "pack", "train")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_flags = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--name", default="tiny", help="results name (bench/results/profile_NAME.txt)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rollouts first")
    p.add_argument("--rollouts", type=int, default=10, help="profiled rollouts")
    p.add_argument("--top", type=int, default=25, help="operators listed")
    args = p.parse_args(own)

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from mileage.cli.main import build_parser
    from mileage.components import build_run, restore
    from mileage.preflight import preflight
    from mileage.rollout.rollout import generate_samples
    from mileage.run_config import RunConfig
    from mileage.training.batch import pack_samples

    total = args.warmup + args.rollouts
    ns = build_parser().parse_args(["train", *TINY_STEP, *train_flags, "--num-rollout", str(total)])
    cfg = RunConfig.from_args(ns)
    pre = preflight(cfg)
    run = build_run(cfg, pre, print)
    restore(run, print)
    rc = cfg.rollout

    def one_rollout(rollout_id: int, walls: dict | None) -> None:
        marks = [time.perf_counter()]
        with record_function("generate"):
            prompts = run.data.next_batch(rc.rollout_batch_size)
            samples = generate_samples(
                run.engine, run.encode, prompts, run.sampling, rc.n_samples_per_prompt,
                run.reward_fn, cfg.loop.seed, rollout_id,
            )  # fmt: skip
        marks.append(time.perf_counter())
        with record_function("pack"):
            batch = pack_samples(samples, run.tokenizer.pad_token_id)
        marks.append(time.perf_counter())
        with record_function("train"):
            run.actor.train_rollout(batch)
        marks.append(time.perf_counter())
        if walls is not None:
            for phase, start, stop in zip(PHASES, marks[:-1], marks[1:], strict=True):
                walls[phase].append(stop - start)

    for rollout_id in range(args.warmup):
        one_rollout(rollout_id, None)
    walls: dict[str, list[float]] = defaultdict(list)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for rollout_id in range(args.warmup, total):
            one_rollout(rollout_id, walls)

    machine = machine_info(cfg.loop.num_threads)
    lines = [
        f"profile of {args.rollouts} rollouts after {args.warmup} untimed ones; "
        f"train flags: {' '.join(TINY_STEP + train_flags)}",
        f"machine: {machine['cpu']['model']}, {machine['cpu']['cores']} cores, "
        f"torch {torch.__version__}, {cfg.loop.num_threads} threads, load {load_average()}",
        "",
        "phase      mean wall s (under the profiler)",
    ]
    step = sum(sum(v) for v in walls.values()) / args.rollouts
    for phase in PHASES:
        mean = sum(walls[phase]) / args.rollouts
        lines.append(f"{phase:<10} {mean:.4f}  ({100 * mean / step:.0f} %)")
    lines += [f"{'step':<10} {step:.4f}", ""]
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"profile_{args.name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
