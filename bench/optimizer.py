"""Benchmark: one AdamW step over a real model's parameters, per torch implementation.

`torch.optim.AdamW` has three CPU paths: the per-tensor loop (`foreach=False`), the multi-tensor
one (`foreach=True`) and the fused kernel (`fused=True`), which reads and writes each parameter,
gradient and moment once per step instead of once per elementwise op. This times a step of
each, with mileage's parameter groups (decay on matrices only) and random gradients, and checks
whether the fused step's values equal the loop's bit for bit.

    python bench/optimizer.py                                    # the built-in model
    python bench/optimizer.py --hf-checkpoint "$(mileage smollm2)" --threads 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import machine_info, output_path, print_table, write_results

IMPLEMENTATIONS = {
    "loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def parameters(hf_checkpoint: str | None):
    from mileage.models.hf import load_causal_lm
    from mileage.rollout.builtin_model import ensure_builtin_model

    if hf_checkpoint is None:
        hf_checkpoint = str(ensure_builtin_model("addition", log=lambda *_: None))
    return load_causal_lm(hf_checkpoint), hf_checkpoint


def step_times(model, options: dict, steps: int, warmup: int) -> tuple[list[float], list]:
    """Seconds per optimizer.step() and the parameters after the last one."""
    import copy

    import torch

    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.01, **options)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        start = time.perf_counter()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times, [p.detach().clone() for p in params]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-checkpoint", help="an HF model directory (default: built-in)")
    parser.add_argument("--threads", default="1,2", help="torch threads to measure, e.g. 1,2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="also write bench/results/<OUT>.json")
    args = parser.parse_args(argv)
    out = output_path(args.out) if args.out else None
    import torch

    model, source = parameters(args.hf_checkpoint)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        results = {
            name: step_times(model, options, args.steps, args.warmup)
            for name, options in IMPLEMENTATIONS.items()
        }
        loop_median = statistics.median(results["loop"][0])
        for name, (times, values) in results.items():
            same = all(torch.equal(a, b) for a, b in zip(values, results["loop"][1], strict=True))
            rows.append(
                {
                    "threads": threads,
                    "implementation": name,
                    "step_s": statistics.median(times),
                    "range": f"{min(times):.3g}-{max(times):.3g}",
                    "vs_loop": statistics.median(times) / loop_median,
                    "equal_to_loop": same,
                }
            )
    print(f"AdamW over {count / 1e6:.1f}M parameters ({source}), {args.steps} timed steps")
    print_table(
        rows,
        [
            ("threads", "threads"),
            ("implementation", "AdamW"),
            ("step_s", "s / step (median)"),
            ("range", "range"),
            ("vs_loop", "vs loop"),
            ("equal_to_loop", "bit-equal to loop"),
        ],
    )
    if out is not None:
        write_results(out, {"machine": machine_info(0), "source": source, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
