"""SFT, then GRPO, on the recipe's reasoning-gym task (docs/recipe.md), scored item by item.

    python scripts/recipe_sft_grpo.py [OUT_DIR]       (default runs/recipe_sft_grpo)
    python scripts/recipe_sft_grpo.py OUT --sft-rollouts 40 --sft-lr 3e-5 --grpo-rollouts 20

1. `mileage sft` of SmolLM2-135M-Instruct on the task's training answers (the bare number, then
   the end of the turn), `--sft-rollouts` steps of 16 records, into OUT/sft;
2. `mileage train --load OUT/sft` with the recipe's GRPO flags (scripts/recipe_gym_arithmetic.sh),
   into OUT/grpo: RL from the SFT weights with a fresh optimizer and data position;
3. greedy scores of the 100 held-out items under the start model, the SFT checkpoint and the
   GRPO checkpoint: exact answers of each, and paired bootstrap intervals (SFT minus start, GRPO
   minus SFT). Writes OUT/summary.json.

Rerunning resumes whatever a kill interrupted; a finished stage is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_ds_paired import paired  # noqa: E402
from recipe_paired_eval import MAX_LEN, TASK, item_scores  # noqa: E402

from mileage.checkpoint.layout import read_tracker  # noqa: E402
from mileage.cli.model_commands import default_smollm2_dir  # noqa: E402


def run(stage: list[str], out: Path, log: Path) -> None:
    cmd = [sys.executable, "-m", "mileage", *stage, "--save", str(out)]
    with open(log, "a") as handle:
        subprocess.run(cmd, check=True, stdout=handle, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/recipe_sft_grpo")
    ap.add_argument("--sft-rollouts", type=int, default=40)
    ap.add_argument("--sft-lr", default="3e-5")
    ap.add_argument("--grpo-rollouts", type=int, default=20)
    ap.add_argument(
        "--held-out",
        type=int,
        default=100,
        help="held-out items the three checkpoints are scored on (training evaluates on the "
        "first 100 either way; a larger split starts with those 100)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = os.environ.get("THREADS", "2")
    hf = str(default_smollm2_dir())
    common = ["--hf-checkpoint", hf, "--prompt-data", TASK, "--apply-chat-template",
              "--rollout-max-response-len", str(MAX_LEN), "--eval-interval", "10",
              "--num-threads", threads]  # fmt: skip
    sft, grpo = out / "sft", out / "grpo"
    # the last SFT checkpoint only: SmolLM2's are 1.6 GB each
    run(["sft", *common, "--num-rollout", str(args.sft_rollouts), "--rollout-batch-size", "16",
         "--lr", args.sft_lr, "--load", str(sft), "--save-keep-last", "1"],
        sft, out / "sft.log")  # fmt: skip
    run(["train", *common, "--num-rollout", str(args.grpo_rollouts), "--rollout-batch-size", "8",
         "--n-samples-per-prompt", "8", "--rollout-temperature", "1.0", "--lr", "1e-5",
         # the SFT run: a rerun finds this RL run's own checkpoints in --save and resumes them
         "--load", str(sft), "--save-interval", "10", "--save-keep-last", "1"], grpo, out / "grpo.log")  # fmt: skip
    last_sft, last_grpo = read_tracker(sft).iteration, read_tracker(grpo).iteration
    task = f"{TASK}&eval_size={args.held_out}" if args.held_out != 100 else TASK
    scored = [*common[:3], task, *common[4:]]  # the same flags, the held-out split resized
    start = item_scores([*scored, "--num-rollout", "1"])
    after_sft = item_scores([*scored, "--load", str(sft), "--num-rollout", str(last_sft + 2)])
    after_grpo = item_scores([*scored, "--load", str(grpo), "--num-rollout", str(last_grpo + 2)])
    summary = {
        "held_out_items": len(start),
        "sft": {"rollouts": args.sft_rollouts, "records_per_rollout": 16, "lr": args.sft_lr},
        "grpo": {"rollouts": args.grpo_rollouts, "lr": "1e-5"},
        "exact": {"start": sum(s >= 1.0 for s in start),
                  "sft": sum(s >= 1.0 for s in after_sft),
                  "sft_grpo": sum(s >= 1.0 for s in after_grpo)},  # fmt: skip
        "score": {name: round(sum(v) / len(v), 4)
                  for name, v in (("start", start), ("sft", after_sft), ("sft_grpo", after_grpo))},
        "sft_minus_start": paired(after_sft, start),
        "grpo_minus_sft": paired(after_grpo, after_sft),
        "grpo_minus_sft_exact": paired([float(s >= 1.0) for s in after_grpo],
                                       [float(s >= 1.0) for s in after_sft]),
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
