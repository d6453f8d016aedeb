"""Where one RL step's time goes: the torch profiler around real `mileage train` rollouts.

Builds the run exactly as `mileage train` does (same flags, same components), runs a few
untimed rollouts, times the next ones phase by phase without the profiler (with each phase's
minor page faults; the process keeps freed memory as `mileage` does, unless
`--glibc-default-malloc`), then profiles as many again: generate (sampling + scoring), pack
(samples -> padded tensors), train (forward, backward, clip, AdamW). Prints the wall time of each phase, the operators with the most self CPU
time, and how close the training pass comes to the host's matmul limit: the matmul FLOPs the
profiler counts inside the train phase (`with_flops`: mm, addmm, bmm, with their shapes),
divided by the train phase's unprofiled wall time, against `_common.matmul_limits` for the run's
precision (square matmuls, same threads). Writes it all to bench/results/profile_NAME.txt and
the figures to bench/results/profile_NAME.json.

    python bench/profile_step.py --name tiny
    python bench/profile_step.py --name smollm2 --rollouts 3 -- \
        --hf-checkpoint "$(mileage smollm2)" --rollout-batch-size 4 --n-samples-per-prompt 4 \
        --rollout-max-response-len 32

Flags after `--` are `mileage train` flags; the defaults are the RL-step benchmark's tiny config.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import defaultdict

from _common import RESULTS, load_average, machine_info, matmul_limits, write_results

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
    p.add_argument(
        "--glibc-default-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (the `mileage` process keeps freed memory instead: "
        "mileage/allocator.py), to measure what that changes",
    )
    args = p.parse_args(own)
    if not args.glibc_default_malloc:
        from mileage.allocator import keep_freed_memory

        keep_freed_memory()  # as the `mileage` process does before anything else

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from mileage.cli.main import build_parser
    from mileage.components import build_run, restore
    from mileage.precision import precision_of
    from mileage.preflight import preflight
    from mileage.rollout.rollout import generate_samples
    from mileage.run_config import RunConfig
    from mileage.training.batch import pack_samples

    total = args.warmup + 2 * args.rollouts
    ns = build_parser().parse_args(["train", *TINY_STEP, *train_flags, "--num-rollout", str(total)])
    cfg = RunConfig.from_args(ns)
    pre = preflight(cfg)
    run = build_run(cfg, pre, print)
    restore(run, print)
    rc = cfg.rollout

    def one_rollout(rollout_id: int, walls: dict | None, faults: dict | None = None) -> None:
        marks = [time.perf_counter()]
        minflt = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt]
        with record_function("generate"):
            prompts = run.data.next_batch(rc.rollout_batch_size)
            samples = generate_samples(
                run.engine, run.encode, prompts, run.sampling, rc.n_samples_per_prompt,
                run.reward_fn, cfg.loop.seed, rollout_id,
            )  # fmt: skip
        marks.append(time.perf_counter())
        minflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        with record_function("pack"):
            batch = pack_samples(samples, run.tokenizer.pad_token_id)
        marks.append(time.perf_counter())
        minflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        with record_function("train"):
            run.actor.train_rollout(batch)
        marks.append(time.perf_counter())
        minflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        if walls is not None:
            for phase, start, stop in zip(PHASES, marks[:-1], marks[1:], strict=True):
                walls[phase].append(stop - start)
        if faults is not None:
            for phase, start, stop in zip(PHASES, minflt[:-1], minflt[1:], strict=True):
                faults[phase].append(stop - start)

    for rollout_id in range(args.warmup):
        one_rollout(rollout_id, None)
    clean: dict[str, list[float]] = defaultdict(list)  # the same work without the profiler
    faults: dict[str, list[int]] = defaultdict(list)  # minor page faults, the same rollouts
    for rollout_id in range(args.warmup, args.warmup + args.rollouts):
        one_rollout(rollout_id, clean, faults)
    # the limit is measured before the profiler runs: its event records held ~20 GB on SmolLM2,
    # and a limit measured after them came out at half the idle machine's
    precision = precision_of(run.actor.model)
    limits = matmul_limits(cfg.loop.num_threads)[precision]
    walls: dict[str, list[float]] = defaultdict(list)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for rollout_id in range(args.warmup + args.rollouts, total):
            one_rollout(rollout_id, walls)
    train_ops = phase_ops(prof.events(), "train")
    train_gflop = sum(row[2] for row in train_ops.values()) / args.rollouts / 1e9

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
    train_s = sum(clean["train"]) / args.rollouts
    achieved = train_gflop / train_s
    lines += [
        "phase      mean wall s without the profiler, minor page faults"
        + (" (glibc's default malloc)" if args.glibc_default_malloc else ""),
        *(
            f"{phase:<10} {sum(clean[phase]) / args.rollouts:.4f}  "
            f"{sum(faults[phase]) // args.rollouts:>9}"
            for phase in PHASES
        ),
        "",
        f"training pass: {train_gflop:.1f} GFLOP of matmuls per rollout in {train_s:.3f} s = "
        f"{achieved:.0f} GFLOP/s; {precision} matmul limit on this host "
        + ", ".join(f"{n}^3 {v:.0f}" for n, v in limits.items())
        + f" GFLOP/s; {100 * achieved / max(limits.values()):.0f} % of the best",
        "",
    ]
    lines += ["the train phase's operators (self CPU time; GFLOP/s of the matmul kernels)"]
    lines += ops_table(train_ops, args.top)
    lines += ["", "all phases"]
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"profile_{args.name}.txt").write_text(text + "\n")
    write_results(
        RESULTS / f"profile_{args.name}.json",
        {
            "machine": machine,
            "flags": TINY_STEP + train_flags,
            "precision": precision,
            "walls_s": {p: sum(clean[p]) / args.rollouts for p in PHASES},
            "minor_page_faults": {p: sum(faults[p]) // args.rollouts for p in PHASES},
            "glibc_default_malloc": args.glibc_default_malloc,
            "walls_profiled_s": {p: sum(walls[p]) / args.rollouts for p in PHASES},
            "train_gflop": train_gflop,
            "train_gflops": achieved,
            "matmul_limit_gflops": limits,
        },
    )
    return 0


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def phase_ops(events, phase: str) -> dict[str, list[float]]:
    """Per operator inside `phase`'s record_function ranges: [self CPU us, calls, FLOPs]. FLOPs
    are counted for the matmul kernels only (the profiler also estimates elementwise mul/add,
    and a matmul is counted once, at its kernel, never at aten::matmul or aten::linear above it).
    Attention's FLOPs are not counted, so the share of the limit is a lower bound."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == phase]
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for event in events:
        if event.name == phase or not any(a <= event.time_range.start <= b for a, b in ranges):
            continue
        row = ops[event.name]
        row[0] += event.self_cpu_time_total
        row[1] += 1
        row[2] += (event.flops or 0) if event.name in MATMULS else 0
    return ops


def ops_table(ops: dict[str, list[float]], top: int) -> list[str]:
    total = sum(row[0] for row in ops.values())
    lines = [f"{'operator':<55} {'self ms':>9} {'%':>6} {'calls':>7} {'GFLOP/s':>8}"]
    for name, (us, calls, flops) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        rate = f"{flops / us / 1e3:8.0f}" if flops else ""
        lines.append(f"{name[:55]:<55} {us / 1e3:9.1f} {100 * us / total:6.1f} {calls:7d} {rate}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
