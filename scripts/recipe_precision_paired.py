"""The recipe of docs/recipe.md in fp32 and under `--precision auto`, side by side: the wall-clock
gain of auto and its held-out score against fp32's on the same items.

    python scripts/recipe_precision_paired.py [OUT_DIR]      (default runs/recipe_precision)
    python scripts/recipe_precision_paired.py OUT --rollouts 20 --cores 0,1
    python scripts/recipe_precision_paired.py runs/demo_precision --demo   (the README's demo:
        the built-in task, its default flags and 150 rollouts, scored on its 500 held-out sums)

Both arms run the same schedule (`--rollouts`, the recipe's 20) at the same time, each pinned to
its own core with `--num-threads 1`, so each sees the same neighbour for most of its run; the
flags are those of `scripts/recipe_ds_paired.py` (the recipe's, one thread, micro-batches of 16).
Auto resolves to bf16 only on a CPU (or GPU) that computes bf16 natively; on a host without it
both arms are fp32 and the script says so before it starts.

Reported: each arm's wall and CPU seconds, its median rollout time (first rollout left out) and
the generation / training split from metrics.jsonl, the gain (fp32 over auto), and greedy scores
of the held-out items for the start model and both final checkpoints, each scored in its own
precision, with paired bootstrap intervals. Writes OUT/summary.json and OUT/items.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_ds_paired import paired, recipe_flags, records, run_arms, score  # noqa: E402

ARMS = {"fp32": ["--precision", "fp32"], "auto": ["--precision", "auto"]}


def timing(run_dir: Path, wall: float, cpu: float) -> dict:
    """What one arm's run cost: whole-process seconds and per-rollout medians (the first rollout,
    which also warms up, left out)."""
    rows = records(run_dir)[1:]

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 3)

    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "rollouts": len(rows) + 1,
            "step_s_median": med("step_time"), "gen_s_median": med("gen_time"),
            "train_s_median": med("train_time")}  # fmt: skip


def gains(fp32: dict, auto: dict) -> dict:
    """fp32's cost over auto's: above 1, auto is faster."""
    keys = ("wall_s", "cpu_s", "step_s_median", "gen_s_median", "train_s_median")
    return {key: round(fp32[key] / auto[key], 3) for key in keys}


def resolved_precision(flags: list[str]) -> str:
    """The precision `--precision auto` resolves to on this host, as a run would decide it."""
    import torch

    from mileage.precision import resolve

    return resolve(flags[flags.index("--precision") + 1], torch.device("cpu"))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/recipe_precision")
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--cores", default="0,1", help="the fp32 arm's core, the auto arm's core")
    ap.add_argument("--lr", default="1e-5")
    ap.add_argument("--temperature", default="1.0")
    ap.add_argument("--eval-only", action="store_true", help="score the arms of OUT/summary.json")
    ap.add_argument(
        "--demo", action="store_true", help="the README's default run instead of the recipe"
    )
    ap.add_argument("--seed", type=int, help="both arms' --seed (default: mileage's)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.demo:  # `mileage train`'s defaults (150 rollouts), one thread per arm
        base = ["--eval-interval", "0", "--num-threads", "1"]
        args.rollouts = 150 if args.rollouts == 20 else args.rollouts
    else:
        base = recipe_flags(args.lr, args.temperature)
    if args.seed is not None:  # other trajectories: one seed's score can be far off the mean
        base += ["--seed", str(args.seed)]
    auto_is = resolved_precision(ARMS["auto"])
    print(f"--precision auto is {auto_is} on this host", flush=True)
    if args.eval_only:
        summary = json.loads((out / "summary.json").read_text())
    else:
        cores = args.cores.split(",")
        arms = run_arms(
            out,
            [
                (name, core, base + ARMS[name], args.rollouts)
                for name, core in zip(ARMS, cores, strict=True)
            ],  # fmt: skip
            stop_with_first=False,
        )
        cost = {arm.name: timing(arm.dir, arm.wall, arm.cpu) for arm in arms}
        summary = {"run": "demo" if args.demo else "recipe", "auto_resolves_to": auto_is,
                   "rollouts": args.rollouts, "seed": args.seed, "cost": cost,
                   "fp32_over_auto": gains(cost["fp32"], cost["auto"])}  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["held_out"] = evaluate(out, base, args.rollouts)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def evaluate(out: Path, base: list[str], rollouts: int) -> dict:
    """Greedy held-out scores: the start model and each arm's last checkpoint, each in its own
    precision."""
    evals = {}
    for name, precision in ARMS.items():
        evals[f"start_{name}"] = [*base, *precision, "--eval-interval", "10", "--num-rollout", "1"]
        evals[name] = [*base, *precision, "--eval-interval", "10", "--load", str(out / name),
                       "--ckpt-step", str(rollouts - 1), "--num-rollout", str(rollouts + 1)]  # fmt: skip
    rewards = {name: [r for r, _, _ in score(flags)] for name, flags in evals.items()}
    n = len(rewards["fp32"])
    (out / "items.json").write_text(json.dumps(rewards, indent=1))
    return {
        "held_out_items": n,
        "score": {k: round(sum(v) / n, 4) for k, v in rewards.items()},
        "exact": {k: sum(r >= 1.0 for r in v) for k, v in rewards.items()},
        "auto_minus_fp32": paired(rewards["auto"], rewards["fp32"]),
        "fp32_minus_start": paired(rewards["fp32"], rewards["start_fp32"]),
        "auto_minus_start": paired(rewards["auto"], rewards["start_auto"]),
        "start_auto_minus_start_fp32": paired(rewards["start_auto"], rewards["start_fp32"]),
    }


if __name__ == "__main__":
    main()
