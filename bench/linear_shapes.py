"""SmolLM2's linear layers alone, at the shapes one training pass and one decode step give them.

Training: each of a decoder layer's weight shapes (q/o 576x576, k/v 192x576, gate/up 1536x576,
down 576x1536) at `--rows` tokens, as the forward (x @ W^T), the input gradient (g @ W) and the
weight gradient (g^T @ x) multiply them, in GFLOP/s; then the fused q/k/v and gate/up shapes
beside the separate ones. Decode: all 30 layers' weights at `--decode-rows` rows, torch's stock
matmul against the weights reordered once for oneDNN (`mileage.models.packed`'s path), in ms
per step. Operands are random, in `--dtype`; the same threads as a run. Compare with the square
matmul limit of `_common.matmul_limits`, printed first.

    python bench/linear_shapes.py --dtype bf16
    python bench/linear_shapes.py --dtype fp32 --rows 656
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

from _common import DEFAULT_THREADS, machine_info, matmul_limits

HIDDEN, KV, MLP, LAYERS = 576, 192, 1536, 30
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]  # q, k, v, o
LAYER += [(MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]  # gate, up, down


def map_linear(x, weights) -> None:
    import torch.nn.functional as F

    for w in weights:
        F.linear(x, w)


def seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rows", type=int, default=656, help="tokens of a training pass")
    p.add_argument("--decode-rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = p.parse_args(argv)
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cpu = machine_info(args.threads)["cpu"]
    limits = matmul_limits(args.threads)[args.dtype]
    print(f"{cpu['model']} ({', '.join(cpu['flags'])}), {args.threads} threads, {args.dtype}")
    print("square matmul limit GFLOP/s: " + ", ".join(f"{n}^3 {v:.0f}" for n, v in limits.items()))

    m = args.rows
    print(f"\ntraining shapes at {m} rows, GFLOP/s: forward / input grad / weight grad")
    for n, k in sorted(set(LAYER)):
        x, g, w = (torch.randn(*s).to(dtype) for s in ((m, k), (m, n), (n, k)))
        flop = 2 * m * n * k / 1e9
        calls = (partial(F.linear, x, w), partial(torch.mm, g, w), partial(torch.mm, g.t(), x))
        rates = [flop / seconds(fn, args.repeats) for fn in calls]
        print(f"  W {n}x{k}: " + " / ".join(f"{r:.0f}" for r in rates))
    print("\nforward, separate against fused, GFLOP/s")
    for name, parts in (("q,k,v", LAYER[:3]), ("gate,up", LAYER[4:6])):
        x = torch.randn(m, HIDDEN).to(dtype)
        ws = [torch.randn(n, k).to(dtype) for n, k in parts]
        fused = torch.cat(ws)
        flop = 2 * m * HIDDEN * fused.shape[0] / 1e9
        apart = flop / seconds(partial(map_linear, x, ws), args.repeats)
        together = flop / seconds(partial(F.linear, x, fused), args.repeats)
        print(f"  {name}: separate {apart:.0f}, fused {together:.0f}")

    rows = args.decode_rows
    weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in LAYER]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    inputs = {k: torch.randn(rows, k).to(dtype) for k in (HIDDEN, MLP)}

    def stock() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def packed() -> None:
        for w, r in zip(weights, reordered, strict=True):
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], r, None, "none", [], "")

    pair = [seconds(fn, max(3, args.repeats // 6)) * 1e3 for fn in (stock, packed, stock, packed)]
    print(
        f"\ndecode step, {LAYERS} layers' weights at {rows} rows, ms: stock {pair[0]:.1f} / "
        f"{pair[2]:.1f}, reordered {pair[1]:.1f} / {pair[3]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
