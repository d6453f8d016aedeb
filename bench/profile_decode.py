"""Where decode time goes: the torch profiler around one forced 64-token generation.

    python bench/profile_decode.py            # built-in tiny model, batch 64, fp32

The engine and settings of benchmark 2 (temperature 1, top-p 1, EOS ignored), one untimed
warm-up call, then one profiled call; prints the wall time and the top operators.
"""

from __future__ import annotations

import sys
import time

import torch
from _common import DEFAULT_THREADS  # noqa: F401  (puts the repository on sys.path)
from torch.profiler import profile

from mileage.models.hf import load_causal_lm, load_tokenizer
from mileage.models.tiny import ensure_builtin_model
from mileage.rollout.engine import LocalEngine, SamplingParams


def main() -> int:
    torch.set_num_threads(2)
    model_dir = ensure_builtin_model("addition")
    model, tokenizer = load_causal_lm(model_dir).eval(), load_tokenizer(model_dir)
    prompts = [tokenizer.encode("12+34=") for _ in range(64)]
    engine = LocalEngine(model, tokenizer.pad_token_id, eos_id=-1)  # -1: never stop early
    params = SamplingParams(max_new_tokens=64, temperature=1.0, top_p=1.0)
    engine.generate(prompts, params, torch.Generator().manual_seed(0))
    started = time.perf_counter()
    engine.generate(prompts, params, torch.Generator().manual_seed(0))
    print(f"batch 64 x 64 new tokens: {time.perf_counter() - started:.3f} s wall")
    with profile() as prof:
        engine.generate(prompts, params, torch.Generator().manual_seed(0))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
