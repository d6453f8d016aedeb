"""Rebuild the built-in model's shipped weights (maintainers only).

    python scripts/build_builtin_model.py [--task addition] [--check]

Runs the deterministic warm-up of `mileage/rollout/builtin_model.py`, which is `mileage sft` with the
recipe's flags (mileage/rollout/builtin_warmup.py; about three minutes on 2 threads), and
writes `mileage/models/builtin/TASK.safetensors` (fp32, as `save_pretrained` writes it) and
`TASK.json` (recipe, steps, accuracy, sha256, and the CPU and libraries that built it). Then pin
the printed sha256 in `SHIPPED_WEIGHTS` in mileage/rollout/builtin_model.py. Run it after changing the recipe, the
architecture or the task; otherwise users would all receive the same old weights, which is the
point.

The warm-up is reproducible on one CPU, not across instruction sets (AVX2, AVX-512, AMX sum
matmuls in different orders), so `--check` rebuilds into a temporary directory and says whether
this CPU reproduces the shipped file bit for bit (exit 0) or not (exit 1). It is expected to
match on the CPU named in TASK.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mileage.rollout.builtin_model import (  # noqa: E402
    SHIPPED_DIR,
    SHIPPED_WEIGHTS,
    build_builtin_weights,
    file_sha256,
)
from mileage.rollout.tasks import TASKS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", choices=TASKS, default="addition")
    p.add_argument(
        "--check", action="store_true", help="rebuild elsewhere and compare with the shipped file"
    )
    args = p.parse_args(argv)
    pinned = SHIPPED_WEIGHTS.get(args.task)
    if not args.check:
        weights = build_builtin_weights(args.task, SHIPPED_DIR)
        sha = file_sha256(weights)
        print(f"wrote {weights.relative_to(REPO)} ({weights.stat().st_size} bytes)")
        if sha == pinned:
            print(f"identical to the pinned weights (sha256 {sha})")
        else:
            print(
                f'now pin it in mileage/rollout/builtin_model.py SHIPPED_WEIGHTS: "{args.task}": "{sha}"'
            )
        return 0
    if pinned is None:
        print(f"the {args.task} model is not shipped (not in SHIPPED_WEIGHTS); nothing to check")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        weights = build_builtin_weights(args.task, Path(tmp))
        info = json.loads((Path(tmp) / f"{args.task}.json").read_text())
        sha = file_sha256(weights)
    shipped = json.loads((SHIPPED_DIR / f"{args.task}.json").read_text())["built_on"]
    here = info["built_on"]
    if sha == pinned:
        print(f"this CPU ({here['cpu']}, {here['cpu_capability']}) rebuilds the shipped weights")
        return 0
    print(
        f"this CPU ({here['cpu']}, {here['cpu_capability']}) builds sha256 {sha[:16]}..., "
        f"the shipped weights are {pinned[:16]}... (built on {shipped['cpu']}, "
        f"{shipped['cpu_capability']}, torch {shipped['torch']})"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
