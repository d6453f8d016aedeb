"""On-policy distillation against plain GRPO on the built-in task, side by side over seeds.

    python scripts/recipe_opd.py [OUT_DIR]          (default runs/recipe_opd)
    python scripts/recipe_opd.py OUT --seeds 1 2 3 --opd-rollouts 50 --kl-coef 1.0 \
        --opd-recipe "--global-batch-size 32 --lr-decay-style cosine --rollout-temperature 0.7"

The teacher is the README's demo run (`mileage train`, 150 GRPO rollouts, its default seed),
trained into OUT/teacher unless it is there. Then, for each seed, two arms start together from
the shipped built-in model, each pinned to its own core with one thread and evaluated every 10
rollouts on the 500 held-out sums: `grpo` (the demo's flags, 150 rollouts) and `opd` (the same
flags, the same task reward, plus `--use-opd --opd-type fsdp --opd-teacher-load OUT/teacher`,
`--opd-rollouts` rollouts, and the `--opd-recipe` flags). With `--opd-recipe`, a third arm
`recipe` runs those flags without the teacher for `--opd-rollouts` rollouts: what the recipe
alone buys.

Reported (OUT/summary.json): per seed, each arm's held-out accuracy curve, the first evaluation
at which OPD reaches GRPO's final accuracy, the per-rollout reverse KL to the teacher, and the
greedy held-out scores of both final checkpoints item by item, with paired bootstrap intervals
(OPD minus GRPO) per seed and over all seeds' items together.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_ds_paired import paired, records, run_arms, score  # noqa: E402

GRPO_ROLLOUTS = 150
BASE = ["--eval-interval", "10", "--num-threads", "1"]


def ensure_teacher(out: Path) -> Path:
    teacher = out / "teacher"
    if not (teacher / "latest_checkpointed_iteration.txt").exists():
        cmd = [
            sys.executable,
            "-m",
            "mileage",
            "train",
            "--save",
            str(teacher),
            "--load",
            str(teacher),
        ]
        with open(out / "teacher.log", "a") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return teacher


def curve(run_dir: Path) -> dict[int, float]:
    """Held-out accuracy by rollouts trained (0: the start model, metrics.jsonl's rollout -1)."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["rollout_id"] + 1: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}


def final_scores(run_dir: Path, rollouts: int, extra: list[str]) -> list[float]:
    flags = [*BASE, *extra, "--load", str(run_dir), "--ckpt-step", str(rollouts - 1),
             "--num-rollout", str(rollouts + 1)]  # fmt: skip
    return [reward for reward, _, _ in score(flags)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/recipe_opd")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--opd-rollouts", type=int, default=GRPO_ROLLOUTS // 3)
    ap.add_argument("--kl-coef", default="1.0")
    ap.add_argument("--opd-recipe", default="", help="flags of the OPD arm beyond the demo's")
    ap.add_argument("--cores", default="0,1")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = ensure_teacher(out)
    recipe = args.opd_recipe.split()
    opd = ["--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", str(teacher),
           "--opd-kl-coef", args.kl_coef, *recipe]  # fmt: skip
    cores = args.cores.split(",")
    seeds, all_grpo, all_opd = {}, [], []
    for seed in args.seeds:
        seed_dir = out / f"seed{seed}"
        seed_dir.mkdir(exist_ok=True)
        flags = [*BASE, "--seed", str(seed)]
        if not (seed_dir / "grpo" / "latest_checkpointed_iteration.txt").exists():
            # the short arms share the second core while GRPO runs on the first (one thread
            # each: the results do not depend on the timing)
            arms = [("grpo", cores[0], flags, GRPO_ROLLOUTS),
                    ("opd", cores[1], [*flags, *opd], args.opd_rollouts)]  # fmt: skip
            if recipe:
                arms.append(("recipe", cores[1], [*flags, *recipe], args.opd_rollouts))
            run_arms(seed_dir, arms, stop_with_first=False)
        grpo_curve, opd_curve = curve(seed_dir / "grpo"), curve(seed_dir / "opd")
        target = grpo_curve[GRPO_ROLLOUTS]
        reached = next((n for n, acc in sorted(opd_curve.items()) if n and acc >= target), None)
        grpo = final_scores(seed_dir / "grpo", GRPO_ROLLOUTS, ["--seed", str(seed)])
        distilled = final_scores(seed_dir / "opd", args.opd_rollouts, ["--seed", str(seed), *opd])
        all_grpo += grpo
        all_opd += distilled
        seeds[seed] = {
            "grpo_curve": grpo_curve,
            "opd_curve": opd_curve,
            **({"recipe_curve": curve(seed_dir / "recipe")} if recipe else {}),
            "grpo_final": target,
            "opd_reaches_grpo_final_at": reached,
            "opd_reverse_kl": [round(r["opd_reverse_kl"], 4) for r in records(seed_dir / "opd")],
            "greedy_score": {"grpo": sum(grpo) / len(grpo), "opd": sum(distilled) / len(distilled)},
            "opd_minus_grpo": paired(distilled, grpo),
            "greedy_items": {"grpo": grpo, "opd": distilled},  # to pool any subset of seeds
        }
        print(json.dumps({seed: seeds[seed]["opd_minus_grpo"]}), flush=True)
    summary = {
        "teacher": str(teacher),
        "grpo_rollouts": GRPO_ROLLOUTS,
        "opd_rollouts": args.opd_rollouts,
        "opd_kl_coef": float(args.kl_coef),
        "opd_recipe": args.opd_recipe,
        "seeds": seeds,
        "opd_minus_grpo_all_seeds": paired(all_opd, all_grpo),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
