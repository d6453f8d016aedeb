"""Where one RL step's time goes: each aten operator timed inside real `mileage train` rollouts.

Builds the run exactly as `mileage train` does (same flags, same components), runs a few
untimed rollouts, times the next ones phase by phase (with each phase's minor page faults; the
process keeps freed memory as `mileage` does, unless `--glibc-default-malloc`): generate
(sampling + scoring), pack (samples -> padded tensors), train (the mismatch step, forward,
backward, clip, AdamW, as `loop.train` runs them). Then it runs as many rollouts again with
every aten operator timed (`OpTimer`, a dispatch mode: the wall time of each call, autograd's
backward included) and prints, per phase, the operators that took the most, and how close the
training pass comes to the host's matmul limit: the matmul FLOPs of the train phase (mm, addmm,
bmm, from their shapes; attention's are not counted, so the share is a lower bound) divided by
the train phase's untimed wall time, against `_common.matmul_limits` for the run's precision
(square matmuls, same threads). Writes it all to bench/results/profile_NAME.txt and the figures
to bench/results/profile_NAME.json.

Why not the torch profiler: its event records fragment the heap, so the operators that allocate
a large tensor fault its pages in afresh (216,000 minor faults in one SmolLM2 bf16 training
pass that had none unprofiled). Under it, zeroing the [49152, 576] embedding gradient took
180-220 ms and the LM head's gradient cast 220-240 ms; timed here they take 4-11 ms.

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

    from mileage.cli.main import build_parser
    from mileage.components import build_run, restore
    from mileage.precision import precision_of
    from mileage.preflight import preflight
    from mileage.rollout.rollout import generate_samples
    from mileage.run_config import RunConfig
    from mileage.training.batch import pack_samples
    from mileage.training.mismatch import apply_mismatch

    total = args.warmup + 2 * args.rollouts
    ns = build_parser().parse_args(["train", *TINY_STEP, *train_flags, "--num-rollout", str(total)])
    cfg = RunConfig.from_args(ns)
    pre = preflight(cfg)
    run = build_run(cfg, pre, print)
    restore(run, print)
    rc = cfg.rollout
    timer = make_op_timer()

    def one_rollout(rollout_id: int, walls: dict, faults: dict | None = None) -> None:
        marks = [time.perf_counter()]
        minflt = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt]

        def phase_done(next_phase: str) -> None:
            marks.append(time.perf_counter())
            minflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            timer.phase = next_phase

        timer.phase = "generate"
        prompts = run.data.next_batch(rc.rollout_batch_size)
        samples = generate_samples(
            run.engine, run.encode, prompts, run.sampling, rc.n_samples_per_prompt,
            run.reward_fn, cfg.loop.seed, rollout_id,
        )  # fmt: skip
        phase_done("pack")
        batch = pack_samples(samples, run.tokenizer.pad_token_id)
        phase_done("train")
        apply_mismatch(cfg.mismatch, run.engine, run.actor, batch)  # as `loop.train` does
        run.actor.train_rollout(batch)
        run.actor.release_gradients()
        phase_done("")
        for phase, start, stop in zip(PHASES, marks[:-1], marks[1:], strict=True):
            walls[phase].append(stop - start)
        if faults is not None:
            for phase, start, stop in zip(PHASES, minflt[:-1], minflt[1:], strict=True):
                faults[phase].append(stop - start)

    for rollout_id in range(args.warmup):
        one_rollout(rollout_id, defaultdict(list))
    clean: dict[str, list[float]] = defaultdict(list)  # the same work without the timer
    faults: dict[str, list[int]] = defaultdict(list)  # minor page faults, the same rollouts
    for rollout_id in range(args.warmup, args.warmup + args.rollouts):
        one_rollout(rollout_id, clean, faults)
    precision = precision_of(run.actor.model)
    limits = matmul_limits(cfg.loop.num_threads)[precision]
    timed: dict[str, list[float]] = defaultdict(list)
    with timer:
        for rollout_id in range(args.warmup + args.rollouts, total):
            one_rollout(rollout_id, timed)
    train_gflop = sum(row[2] for row in timer.ops["train"].values()) / args.rollouts / 1e9

    machine = machine_info(cfg.loop.num_threads)
    lines = [
        f"{args.rollouts} rollouts timed, then {args.rollouts} with each operator timed, after "
        f"{args.warmup} untimed ones; train flags: {' '.join(TINY_STEP + train_flags)}",
        f"machine: {machine['cpu']['model']}, {machine['cpu']['cores']} cores, "
        f"torch {torch.__version__}, {cfg.loop.num_threads} threads, load {load_average()}",
        "",
        "phase      mean wall s, minor page faults"
        + (" (glibc's default malloc)" if args.glibc_default_malloc else "")
        + "; with each operator timed",
        *(
            f"{phase:<10} {sum(clean[phase]) / args.rollouts:.4f}  "
            f"{sum(faults[phase]) // args.rollouts:>9}  {sum(timed[phase]) / args.rollouts:.4f}"
            for phase in PHASES
        ),
        "",
    ]
    train_s = sum(clean["train"]) / args.rollouts
    achieved = train_gflop / train_s
    lines += [
        f"training pass: {train_gflop:.1f} GFLOP of matmuls per rollout in {train_s:.3f} s = "
        f"{achieved:.0f} GFLOP/s; {precision} matmul limit on this host "
        + ", ".join(f"{n}^3 {v:.0f}" for n, v in limits.items())
        + f" GFLOP/s; {100 * achieved / max(limits.values()):.0f} % of the best",
        "",
    ]
    for phase in ("train", "generate"):
        lines += [f"the {phase} phase's operators (wall ms per rollout; GFLOP/s of the matmuls)"]
        lines += ops_table(timer.ops[phase], args.top, args.rollouts)
        lines.append("")
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
            "walls_op_timed_s": {p: sum(timed[p]) / args.rollouts for p in PHASES},
            "train_gflop": train_gflop,
            "train_gflops": achieved,
            "matmul_limit_gflops": limits,
            "train_ops_ms": {
                name: 1e3 * row[0] / args.rollouts for name, row in timer.ops["train"].items()
            },
        },
    )
    return 0


def matmul_flops(name: str, args: tuple) -> float:
    """The FLOPs of a matmul kernel call from its operands' shapes; 0 for any other operator."""
    if name in ("mm", "bmm"):
        a, b = args[0], args[1]
    elif name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    else:
        return 0.0
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def make_op_timer():
    """A dispatch mode that adds each aten call's wall time, its count and its matmul FLOPs to
    `ops[phase][operator]`; set `phase` between phases. It sees autograd's backward operators
    too (they run in this thread on a CPU). The timed phases take longer than the untimed ones
    (the mode's Python runs between calls), and each call's time carries a few microseconds of
    dispatch: the operators of a SmolLM2 bf16 train phase summed to 1.33 s against 1.17 s
    untimed, so read the table as shares, not as a second wall clock."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpTimer(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.phase = ""
            self.ops: dict[str, dict[str, list[float]]] = defaultdict(
                lambda: defaultdict(lambda: [0.0, 0, 0.0])
            )

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - start
            name = func.overloadpacket.__name__
            row = self.ops[self.phase][name]
            row[0] += seconds
            row[1] += 1
            row[2] += matmul_flops(name, args)
            return out

    return OpTimer()


def ops_table(ops: dict[str, list[float]], top: int, rollouts: int) -> list[str]:
    total = sum(row[0] for row in ops.values())
    lines = [f"{'operator':<55} {'ms':>9} {'%':>6} {'calls':>7} {'GFLOP/s':>8}"]
    for name, (seconds, calls, flops) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        rate = f"{flops / seconds / 1e9:8.0f}" if flops else ""
        lines.append(
            f"{name[:55]:<55} {1e3 * seconds / rollouts:9.1f} {100 * seconds / total:6.1f} "
            f"{calls // rollouts:7d} {rate}"
        )
    lines.append(f"{'all operators':<55} {1e3 * total / rollouts:9.1f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
