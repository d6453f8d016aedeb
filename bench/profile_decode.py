"""Where generation time goes: the engine's wall time over repeats, then the torch profiler around
one more call.

    python bench/profile_decode.py                       # built-in tiny model, 64 x 1 rows, 64 tokens
    python bench/profile_decode.py --prompts 16 --samples 8 --new-tokens 8        # RL-step tiny
    python bench/profile_decode.py --model-dir "$(mileage smollm2)" --prompts 4 --samples 4 \\
        --new-tokens 32                                                          # RL-step SmolLM2

Each of the P prompts ("a+b=" with different numbers) is sent G times, as GRPO does. Sampling is
benchmark 2's (temperature 1, top-p 1, EOS ignored so every row runs all tokens), in the
precision `--precision` resolves to on this host. One untimed warm-up call, `--repeats` timed
ones (median and min printed), then one profiled call; prints the top operators.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import DEFAULT_THREADS
from torch.profiler import profile

from mileage.models.hf import load_causal_lm, load_tokenizer
from mileage.precision import resolve, set_precision
from mileage.rollout.builtin_model import ensure_builtin_model
from mileage.rollout.engine import LocalEngine, SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", help="HF model directory (default: the built-in tiny model)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or str(ensure_builtin_model("addition"))
    precision, why = resolve(args.precision, torch.device("cpu"))
    model = set_precision(load_causal_lm(model_dir).eval(), precision, fp32_lm_head=True)
    tokenizer = load_tokenizer(model_dir)
    prompts = [
        tokenizer.encode(f"{10 + i}+{37 + 3 * i}=")
        for i in range(args.prompts)
        for _ in range(args.samples)
    ]
    engine = LocalEngine(model, tokenizer.pad_token_id, eos_id=-1)  # -1: never stop early
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)

    def call() -> float:
        started = time.perf_counter()
        engine.generate(prompts, params, torch.Generator().manual_seed(0))
        return time.perf_counter() - started

    call()
    walls = [call() for _ in range(args.repeats)]
    shape = f"{args.prompts} x {args.samples} rows x {args.new_tokens} new tokens"
    print(f"{model_dir}, {precision} ({why}), {args.threads} threads, {shape}")
    print(f"wall s: median {statistics.median(walls):.3f}, min {min(walls):.3f}")
    with profile() as prof:
        call()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
