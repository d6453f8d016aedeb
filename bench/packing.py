"""Token-budget packing against padded micro-batches: one global batch's training passes.

A global batch of P prompts x G samples with long-tailed response lengths (log-uniform from
`--min-response` to `--max-response` tokens, seeded), its training forwards and backwards as
the actor runs them (`Batching.rank_parts`, `sequence_logprobs`, a token-mean loss):

    padded   micro-batches of `--micro-batch-size` samples, each right-padded to its longest
             (mileage's default path: each distinct prompt's forward shared within a micro-batch)
    plain    the same micro-batches, every row whole (the padded forward without shared prompts,
             as under FSDP2 or --gradient-checkpointing)
    packed   `--use-dynamic-batch-size --max-tokens-per-gpu BUDGET`: runs of samples of at most
             BUDGET tokens, each packed into one row (`mileage.training.packing`)

Each arm runs in a process of its own (so each peak RSS is its own), arms alternating,
`--rounds` times; each process times `--repeats` passes after one untimed one.

    python bench/packing.py --model-dir "$(mileage smollm2)"
    python bench/packing.py --model-dir "$(mileage smollm2)" --precision bf16
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from _common import DEFAULT_THREADS, machine_info, median, output_path, write_results
from train_pass import padded_batch

ARMS = ("padded", "plain", "packed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", required=True, help="HF model directory")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--min-response", type=int, default=8)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2, help="the padded arm's")
    p.add_argument("--max-tokens-per-gpu", type=int, default=1024, help="the packed arm's")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="processes per arm, alternating")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in this process
    p.add_argument("--out", default="", help="results JSON (default: bench/results/)")
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(args)))
        return 0
    path = output_path(args.out or "packing.json")  # checked before anything is measured
    rows = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--arm", arm]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
            rows[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    info = machine_info(args.threads)
    summary = {
        arm: {
            "pass_s": median([t for r in rows[arm] for t in r["times"]]),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in rows[arm]),
            "tokens_run": rows[arm][0]["tokens_run"],
            "forwards": rows[arm][0]["forwards"],
        }
        for arm in ARMS
    }
    cpu = info["cpu"]
    print(
        f"{cpu['model']} ({', '.join(cpu['flags'])}), {args.threads} threads, {args.precision}; "
        f"{args.prompts}x{args.samples} samples, {args.prompt_len}-token prompts, responses "
        f"{rows['packed'][0]['responses']}"
    )
    for arm in ARMS:
        s = summary[arm]
        print(
            f"  {arm:7s} {s['pass_s']:7.2f} s per global batch, {s['forwards']} forwards of "
            f"{s['tokens_run']} token slots in all, peak RSS {s['peak_rss_gib']:.2f} GiB"
        )
    for base in ("padded", "plain"):
        ratio = summary["packed"]["pass_s"] / summary[base]["pass_s"]
        print(f"  packed / {base} time: {ratio:.2f}x")
    write_results(path, {"machine": info, "args": vars(args), "summary": summary, "runs": rows})
    return 0


def run_arm(args: argparse.Namespace) -> dict:
    from mileage.allocator import keep_freed_memory

    keep_freed_memory()  # as the `mileage` process does
    import torch

    from mileage.models.hf import load_causal_lm
    from mileage.precision import set_precision
    from mileage.training.actor import sequence_logprobs
    from mileage.training.algo import AlgoConfig
    from mileage.training.packing import Batching

    torch.set_num_threads(args.threads)
    model = set_precision(load_causal_lm(args.model_dir), args.precision).train()
    batch, responses = long_tailed_batch(args, model.config.vocab_size)
    if args.arm == "plain":
        batch.prompt_lens = None  # the actor's plain forward: every row whole
    chunk = AlgoConfig().chunk_tokens(model.config.vocab_size)
    n = len(batch)
    packed = args.arm == "packed"
    batching = Batching(args.micro_batch_size, args.max_tokens_per_gpu if packed else None)
    parts = list(batching.rank_parts(batch, 0, n))
    tokens = sum(int(p.attention_mask.sum()) if packed else p.input_ids.numel() for p in parts)

    def one_pass() -> float:
        start = time.perf_counter()
        tokens_total = batch.loss_mask.sum()
        for part in parts:
            logp, _ = sequence_logprobs(
                model, part, 1.0, with_entropy=True, entropy_grad=False, chunk_tokens=chunk
            )
            ((-(logp * part.loss_mask).sum()) / tokens_total).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    one_pass()
    times = [one_pass() for _ in range(args.repeats)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {
        "arm": args.arm,
        "times": times,
        "peak_rss_gib": peak,
        "tokens_run": tokens,
        "forwards": len(parts),
        "responses": responses,
    }


def long_tailed_batch(args: argparse.Namespace, vocab: int):
    """Prompts of random tokens and responses of log-uniform lengths, right-padded."""
    import math

    import torch

    g = torch.Generator().manual_seed(0)
    low, high = math.log(args.min_response), math.log(args.max_response)
    rows, responses = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(100, vocab - 1, (args.prompt_len,), generator=g)
        for _ in range(args.samples):
            length = round(math.exp(low + (high - low) * float(torch.rand((), generator=g))))
            responses.append(length)
            response = torch.randint(100, vocab - 1, (length,), generator=g)
            rows.append(torch.cat([prompt, response]))
    return padded_batch(rows, args.prompt_len), responses


if __name__ == "__main__":
    sys.exit(main())
