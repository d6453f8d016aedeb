"""What the NaN/inf checks cost: `mileage.training.finite.first_nonfinite` (one fused norm over
every tensor, element-wise only when that is not finite) against the element-wise check it
replaced (`torch.isfinite(t).all()` per tensor), interleaved repetition by repetition.

Two workloads from the model in `--model-dir`, fp32: the trained weights (what the actor checks
after every rollout's optimizer steps) and a checkpoint's tensors (the weights and AdamW's two
moments, what every save checks before its commit). Both checks must agree that all are finite.

    python bench/finite_check.py --model-dir "$(mileage smollm2)"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _common import machine_info, median, output_path, print_table, spread, write_results


def elementwise(tensors: list[tuple[str, torch.Tensor]]) -> str | None:
    """The check before the fused one: four passes and a bool copy per tensor."""
    for name, tensor in tensors:
        if torch.is_floating_point(tensor) and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", required=True, help="an HF model directory (SmolLM2's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="finite_check")
    args = p.parse_args(argv)
    out = output_path(args.out)
    torch.set_num_threads(args.threads)

    from mileage.models.hf import load_causal_lm
    from mileage.training.finite import first_nonfinite

    model = load_causal_lm(args.model_dir).float()
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    moments = [(f"{n}.{k}", torch.randn_like(p) * 1e-3) for n, p in weights for k in ("m", "v")]
    workloads = {"weights after a rollout": weights, "a checkpoint's tensors": weights + moments}
    checks: dict[str, Callable] = {"fused (mileage)": first_nonfinite, "element-wise": elementwise}
    times: dict[tuple[str, str], list[float]] = {(w, c): [] for w in workloads for c in checks}
    for _ in range(args.reps + 1):  # the first repetition warms up, untimed
        for workload, tensors in workloads.items():
            for check, fn in checks.items():
                started = time.perf_counter()
                assert fn(tensors) is None, f"{check} found a non-finite tensor in {workload}"
                times[workload, check].append(time.perf_counter() - started)
    rows = []
    for workload, tensors in workloads.items():
        fused, before = (median(times[workload, c][1:]) for c in checks)
        rows.append({
            "workload": workload,
            "gb": f"{sum(t.numel() * t.element_size() for _, t in tensors) / 1e9:.2f}",
            "fused": f"{fused:.3f} ({spread(times[workload, 'fused (mileage)'][1:])})",
            "elementwise": f"{before:.3f} ({spread(times[workload, 'element-wise'][1:])})",
            "ratio": f"{fused / before:.2f}",
        })  # fmt: skip
    print_table(rows, [("workload", "workload"), ("gb", "GB"), ("fused", "fused s"),
                       ("elementwise", "element-wise s"), ("ratio", "fused / element-wise")])  # fmt: skip
    write_results(out, {"machine": machine_info(args.threads), "rows": rows,
                        "times": {f"{w} | {c}": t for (w, c), t in times.items()}})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
