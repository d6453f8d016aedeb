"""One training forward and backward of a model in this process, timed: the pass the actor runs
per micro-batch, without the rest of a run around it.

P prompts of `--prompt-len` random tokens, G samples each with responses of about
`--response-len` tokens (lengths differ by up to 2, as sampled ones do), the log-probs and the
logged entropy through `sequence_logprobs` (each distinct prompt once, as the actor does, or
every row whole with `--plain`), a token-mean loss, its backward. The precision is mileage's
(`set_precision`: bf16 autocast over fp32 weights, or fp32). `--compile` compiles each decoder
layer first (`layer.compile(dynamic=True)`, inductor) and reports how long that took.

    python bench/train_pass.py --model-dir "$(mileage smollm2)" --precision bf16
    python bench/train_pass.py --model-dir "$(mileage smollm2)" --precision bf16 --plain
    python bench/train_pass.py --model-dir "$(mileage smollm2)" --precision bf16 --compile
    python bench/train_pass.py --model-dir "$(mileage smollm2)" --precision fp32 --chunk -1
    python bench/train_pass.py --model-dir "$(mileage smollm2)" --gradient-checkpointing
    python bench/train_pass.py --model-dir "$(mileage smollm2)" --precision fp32 --live-peak
    python bench/train_pass.py --model-dir "$(mileage smollm2)" --precision fp32 --autograd-mlp

The MLPs run mileage's `GatedSiLU`, as a run's policy does; `--autograd-mlp` keeps the
`transformers` forward (its baseline: the same numbers, one more tensor kept per layer).

`--live-peak` runs one more pass under torch's memory profiler and prints the most memory its
tensors held at once (the allocator's view: what glibc keeps beyond it is not counted, nor are
tensors the pass never touches, such as AdamW's moments) and the largest tensors alive then.
"""

from __future__ import annotations

import argparse
import time

from _common import DEFAULT_THREADS, machine_info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", required=True, help="HF model directory")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=36)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed passes (after 2 untimed)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--plain", action="store_true", help="every row whole: no shared prompts")
    p.add_argument("--compile", action="store_true", help="compile each decoder layer first")
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer in the backward (every row whole, as the actor runs)",
    )
    p.add_argument(
        "--chunk", type=int, default=None, help="--log-probs-chunk-size (default: mileage's)"
    )
    p.add_argument(
        "--live-peak", action="store_true", help="profile one more pass: its live tensors' peak"
    )
    p.add_argument(
        "--autograd-mlp", action="store_true", help="the transformers MLP forward, not GatedSiLU"
    )
    args = p.parse_args(argv)

    from mileage.allocator import keep_freed_memory

    keep_freed_memory()  # as the `mileage` process does
    import torch

    from mileage.models.gated_mlp import use_gated_silu
    from mileage.models.hf import load_causal_lm
    from mileage.precision import set_precision
    from mileage.training.actor import sequence_logprobs

    torch.set_num_threads(args.threads)
    model = set_precision(load_causal_lm(args.model_dir), args.precision).train()
    if not args.autograd_mlp:
        use_gated_silu(model)
    batch = random_batch(args, model.config.vocab_size)
    from mileage.training.algo import AlgoConfig

    chunk = AlgoConfig(log_probs_chunk_size=args.chunk).chunk_tokens(model.config.vocab_size)
    if args.plain:
        batch.prompt_lens = None  # the actor's plain forward
    if args.gradient_checkpointing:
        from mileage.models.activation_checkpointing import enable_activation_checkpointing

        enable_activation_checkpointing(model)

    def one_pass() -> float:
        start = time.perf_counter()
        logp, _ = sequence_logprobs(
            model, batch, 1.0, with_entropy=True, entropy_grad=False, chunk_tokens=chunk
        )
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    compile_s = None
    if args.compile:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64  # one graph per layer shape, not per layer
        start = time.perf_counter()
        for layer in model.model.layers:
            layer.compile(dynamic=True)
        one_pass()  # compiles forward and backward
        compile_s = time.perf_counter() - start
    for _ in range(2):
        one_pass()
    times = sorted(one_pass() for _ in range(args.repeats))
    cpu = machine_info(args.threads)["cpu"]
    mode = "plain" if args.plain or args.gradient_checkpointing else "each prompt once"
    mode += ", layers checkpointed" if args.gradient_checkpointing else ""
    print(
        f"{cpu['model']} ({', '.join(cpu['flags'])}), {args.threads} threads; {args.precision}, "
        f"{args.prompts}x{args.samples} rows, {args.prompt_len}-token prompts, {mode}, "
        f"log-prob chunk {chunk}"
        + (f", compiled in {compile_s:.0f} s" if compile_s is not None else "")
    )
    print("forward+backward s: " + " ".join(f"{t:.3f}" for t in times))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"peak RSS {peak:.2f} GiB")
    if args.live_peak:
        live_peak(one_pass)
    return 0


def live_peak(one_pass, largest: int = 8) -> None:
    """Print the most bytes `one_pass`'s tensors held at once and the largest of them then."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        one_pass()
    live: dict = {}
    total = peak = 0
    at_peak: dict = {}
    for _, action, (key, _version), size in prof._memory_profile().timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            live[key] = size
            total += size
        elif action == Action.DESTROY:
            total -= live.pop(key, 0)
        if total > peak:
            peak, at_peak = total, dict(live)
    mib = 1 << 20
    print(f"live peak {peak / mib:.0f} MiB; largest then (MiB):")
    sizes = sorted(at_peak.values(), reverse=True)
    print("  " + " ".join(f"{size / mib:.1f}" for size in sizes[:largest]))
    print(f"  and {len(sizes) - largest} more, {sum(sizes[largest:]) / mib:.0f} MiB in all")


def random_batch(args: argparse.Namespace, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.prompts):
        prompt = torch.randint(100, vocab - 1, (args.prompt_len,), generator=g)
        for s in range(args.samples):
            response = torch.randint(100, vocab - 1, (args.response_len - s % 3,), generator=g)
            rows.append(torch.cat([prompt, response]))
    return padded_batch(rows, args.prompt_len)


def padded_batch(rows: list, prompt_len: int):
    """Token rows (each a `prompt_len`-token prompt and its response) right-padded into a
    TrainBatch, as `pack_samples` lays samples out."""
    import torch

    from mileage.training.batch import TrainBatch

    n, width = len(rows), max(len(r) for r in rows)
    ids = torch.zeros((n, width), dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        attention[i, : len(row)] = 1
        loss_mask[i, prompt_len - 1 : len(row) - 1] = 1
    prompt_lens = torch.full((n,), prompt_len)
    return TrainBatch(
        ids,
        attention,
        loss_mask,
        torch.zeros_like(loss_mask),
        torch.zeros(n),
        prompt_lens=prompt_lens,
    )


if __name__ == "__main__":
    raise SystemExit(main())
