"""How likely sampling is to produce an exact answer, per model and sampling temperature: the
teacher-forced probability of each held-out item's bare label followed by the end of the turn,
under the logits divided by the temperature, averaged over the 100 held-out items of
docs/recipe.md.

    python scripts/recipe_exact_probability.py runs/recipe_ds [--temperatures 1.0,1.5,2.0]

RUN_DIR is an output of scripts/recipe_ds_paired.py: it scores the starting model and the
checkpoints summary.json judged for the plain and ds arms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipe_ds_paired as paired  # noqa: E402


def exact_probabilities(flags: list[str], temperatures: list[float]) -> dict[str, float]:
    import torch

    from mileage.cli.main import build_parser
    from mileage.components import build_run, restore
    from mileage.preflight import preflight
    from mileage.run_config import RunConfig

    cfg = RunConfig.from_args(build_parser().parse_args(["train", *flags]))
    run = build_run(cfg, preflight(cfg), lambda *_: None)
    restore(run, lambda *_: None)
    model = run.model.eval()
    probs: dict[float, list[float]] = {t: [] for t in temperatures}
    with torch.no_grad():
        for prompt in run.eval_sets[0].prompts:
            head = run.encode.prompt_ids(prompt)
            tail = [*run.tokenizer(prompt.label, add_special_tokens=False)["input_ids"],
                    run.engine.eos_id]  # fmt: skip
            logits = model(torch.tensor([head + tail])).logits[0, len(head) - 1 : -1].float()
            for t in temperatures:
                picked = (logits / t).log_softmax(-1).gather(1, torch.tensor(tail)[:, None])
                probs[t].append(math.exp(float(picked.sum())))
    return {str(t): float(f"{sum(v) / len(v):.3g}") for t, v in probs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--temperatures", default="1.0,1.5,2.0")
    args = ap.parse_args()
    out = Path(args.run_dir)
    summary = json.loads((out / "summary.json").read_text())
    temperatures = [float(t) for t in args.temperatures.split(",")]
    base = paired.recipe_flags("1e-5", "1.0")
    ds = paired.arm_flags("ds", 100, 8)
    plain_iter = summary["commits"]["plain"][-1]["iteration"]
    ds_iter = summary["ds_arm"]["judged_iteration"]["iteration"]
    models = {
        "start": [*base, "--eval-interval", "10", "--num-rollout", "1"],
        "plain": [*base, "--eval-interval", "10", "--load", str(out / "plain"),
                  "--ckpt-step", str(plain_iter), "--num-rollout", str(plain_iter + 2)],
        "ds": [*base, *ds, "--eval-interval", "10", "--load", str(out / "ds"),
               "--ckpt-step", str(ds_iter), "--num-rollout", str(ds_iter + 2)],
    }  # fmt: skip
    result = {name: exact_probabilities(flags, temperatures) for name, flags in models.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
