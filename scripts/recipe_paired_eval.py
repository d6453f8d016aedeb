"""Paired held-out comparison for the recipe of docs/recipe.md: the greedy score of every
held-out item under the starting SmolLM2 and under RUN_DIR's last checkpoint, the mean
difference with a bootstrap 95 % interval, and how many items improved or got worse.

    python scripts/recipe_paired_eval.py runs/recipe     (after scripts/recipe_gym_arithmetic.sh)

The flags must be the recipe's (LEN/LR/TEMP as the script's defaults); the data, the held-out
items and the reward are then the ones the run used. A LoRA run (LORA=N) is loaded with the
adapter flags its checkpoint records; THREADS sets --num-threads (default 2).
"""

from __future__ import annotations

import json
import os
import random
import sys

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.meta import recorded_lora
from mileage.cli.main import build_parser
from mileage.cli.model_commands import default_smollm2_dir
from mileage.components import build_run, restore
from mileage.preflight import preflight
from mileage.rollout.engine import SamplingParams
from mileage.rollout.rollout import generate_samples
from mileage.run_config import RunConfig

TASK = (
    "gym:basic_arithmetic?size=2000&seed=1&min_digits=1&max_digits=2&max_terms=2&operators=+"
    "&allow_parentheses=false&allow_negation=false&instruction=Reply with only the number."
)
MAX_LEN = 16


def item_scores(flags: list[str]) -> list[float]:
    cfg = RunConfig.from_args(build_parser().parse_args(["train", *flags]))
    run = build_run(cfg, preflight(cfg), lambda *_: None)
    restore(run, lambda *_: None)
    params = SamplingParams(max_new_tokens=MAX_LEN, temperature=0.0)
    samples = generate_samples(
        run.engine,
        run.encode,
        run.eval_sets[0].prompts,
        params,
        1,
        run.reward_fn,
        seed=0,
        rollout_id=0,
    )
    return [s.reward for s in samples]


def main(run_dir: str) -> None:
    flags = ["--hf-checkpoint", str(default_smollm2_dir()), "--prompt-data", TASK,
             "--apply-chat-template", "--rollout-max-response-len", str(MAX_LEN),
             "--eval-interval", "10", "--num-threads", os.environ.get("THREADS", "2")]  # fmt: skip
    last = read_tracker(run_dir).iteration
    lora = recorded_lora(str(checkpoint_path(run_dir, last)))
    adapter = []
    if lora is not None:  # the adapter's own flags, or the resume refuses the checkpoint
        adapter = ["--lora-rank", str(lora["lora_rank"]), "--lora-alpha", str(lora["lora_alpha"]),
                   "--lora-dropout", str(lora["lora_dropout"]),
                   "--target-modules", ",".join(lora["target_modules"])]  # fmt: skip
    before = item_scores([*flags, "--num-rollout", "1"])
    after = item_scores([*flags, *adapter, "--load", run_dir, "--num-rollout", str(last + 2)])
    n = len(before)
    diff = [a - b for a, b in zip(after, before, strict=True)]
    rng = random.Random(0)
    means = sorted(sum(rng.choice(diff) for _ in range(n)) / n for _ in range(10_000))
    print(json.dumps({
        "held_out_items": n, "checkpoint": f"iter_{last:07d}", "lora": lora is not None,
        "score_before": round(sum(before) / n, 4), "score_after": round(sum(after) / n, 4),
        "mean_difference": round(sum(diff) / n, 4),
        "bootstrap_95": [round(means[250], 4), round(means[9749], 4)],
        "items_improved": sum(d > 0 for d in diff), "items_worse": sum(d < 0 for d in diff),
        "exact_before": sum(b >= 1.0 for b in before), "exact_after": sum(a >= 1.0 for a in after),
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
