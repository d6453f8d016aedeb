"""Benchmark 2: sampling throughput of mileage's LocalEngine against `transformers` generate
(and vLLM's OpenAI server with `--vllm-python`).

Both sample the same prompts from the same model at temperature 1, top-p 1, and are forced to
produce exactly `--new-tokens` tokens per row (EOS ignored: eos id -1 for the engine,
`eos_token_id=None` for `generate`, which then keeps sampling past EOS without adding a logits
processor). Prompts are the built-in `mixed` task (addition and string reversal), so rows have
different lengths and left padding is exercised. Runs of the two engines alternate, after one
short warm-up each, and the median is reported with the min-max of the repeats.

    python bench/generation.py                                  # tiny model, fp32 + bf16
    python bench/generation.py --smollm2-dir "$(mileage smollm2)"   # adds SmolLM2-135M (fp32)
    python bench/generation.py --skip-tiny --smollm2-dir DIR --smollm2-dtypes fp32,bf16 \
        --vllm-python "$MILEAGE_HOME/vllm-venv/bin/python"           # adds vLLM (CPU backend)

vLLM is launched once per model and dtype (`--dtype`, the same process-group supervisor as
`--rollout-engine vllm`, loopback only) and gets the batch as that many concurrent
/v1/completions requests of token ids, with `ignore_eos` and `min_tokens` so every row has
exactly `--new-tokens` tokens; its start-up is not timed. Its throughput counts the whole
round trip (HTTP, JSON, detokenization it does anyway), which is what a trainer sees.

A precision (`--dtypes`) is what a training run with `--precision` generates in: fp32 weights,
and in bf16 every step under bf16 autocast (`mileage.precision`), for `generate` too; vLLM gets
`--dtype`. The host's bf16 CPU flags and matmul limit per precision (`_common.matmul_limits`)
are recorded beside the throughputs. In bf16 mileage's engine samples from fp32 logits, as a
run does by default; `bf16-logits` is the engine of `--no-fp32-lm-head` (bf16-rounded logits,
the LM head in bf16 like `generate`'s).
"""

from __future__ import annotations

import argparse
import gc

from _common import (
    DEFAULT_THREADS,
    Stopwatch,
    load_average,
    machine_info,
    matmul_limits,
    median,
    output_path,
    print_table,
    spread,
    write_results,
)

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="64,256", help="comma-separated (default 64,256)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--dtypes",
        default="fp32,bf16",
        help="for the tiny model: fp32, bf16, bf16-logits (default fp32,bf16)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and setting")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--smollm2-dir", default=None, help="converted SmolLM2 HF dir (adds that model)")
    p.add_argument("--smollm2-batch-sizes", default="64,256")
    p.add_argument("--smollm2-dtypes", default="fp32", help="bf16 is ~10x slower without bf16 HW")
    p.add_argument("--smollm2-repeats", type=int, default=2)
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument(
        "--vllm-python", help="Python of a vLLM venv: adds vLLM (scripts/install_vllm.sh)"
    )
    p.add_argument("--vllm-args", default="--kv-cache-memory-bytes 4G --max-num-seqs 256")
    p.add_argument(
        "--out",
        default="generation",
        help="results file: a bare NAME is bench/results/NAME.json, a path is used as given "
        "(.json added when missing)",
    )
    return p.parse_args(argv)


def mixed_prompts(tokenizer, count: int) -> list[list[int]]:
    from mileage.rollout.tasks import builtin_task

    records = builtin_task("mixed")[0][:count]
    return [tokenizer(r["prompt"])["input_ids"] for r in records]


def engine_run(model, tokenizer, prompts, new_tokens: int, seed: int):
    import torch

    from mileage.rollout.engine import LocalEngine, SamplingParams

    engine = LocalEngine(model, tokenizer.pad_token_id, eos_id=-1, max_batch_size=len(prompts))
    params = SamplingParams(new_tokens, temperature=1.0, top_p=1.0)
    out = engine.generate(prompts, params, torch.Generator().manual_seed(seed))
    assert all(len(c.response_ids) == new_tokens for c in out)


def hf_run(model, tokenizer, prompts, new_tokens: int, seed: int):
    import torch

    from mileage.precision import autocast

    tokenizer.padding_side = "left"
    enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.inference_mode(), autocast(model):
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
    assert out.shape[1] - enc["input_ids"].shape[1] == new_tokens


class VLLMServer:
    """A launched `vllm serve` of `model_dir`; calling it samples a batch like the runners above."""

    def __init__(self, model_dir: str, dtype_name: str, args):
        from pathlib import Path

        from mileage.rollout.engines.config import EngineConfig
        from mileage.rollout.engines.vllm_server import launch_vllm

        cfg = EngineConfig(
            rollout_engine="vllm",
            vllm_python=args.vllm_python,
            vllm_args=f"{args.vllm_args} --dtype {DTYPES[dtype_name]}",
        )
        self.server, self.url = launch_vllm(cfg, Path(model_dir), model_dir, print)

    def __call__(self, model, tokenizer, prompts, new_tokens: int, seed: int):
        from concurrent.futures import ThreadPoolExecutor

        from mileage.rollout.engines.http import post_json
        from mileage.rollout.engines.vllm_server import SERVED_NAME

        def one(row: int) -> int:
            payload = {
                "model": SERVED_NAME,
                "prompt": prompts[row],
                "max_tokens": new_tokens,
                "min_tokens": new_tokens,
                "ignore_eos": True,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "seed": seed * 100_003 + row,
                "logprobs": 0,
                "return_token_ids": True,
            }
            reply = post_json(self.url + "/v1/completions", payload, timeout=1800)
            return len(reply["choices"][0]["token_ids"])

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            lengths = list(pool.map(one, range(len(prompts))))
        assert lengths == [new_tokens] * len(prompts), lengths

    def stop(self) -> None:
        self.server.stop()


def bench_model(name, model_dir, dtypes, batch_sizes, args, repeats) -> list[dict]:
    from mileage.models.hf import load_causal_lm, load_tokenizer
    from mileage.precision import set_precision

    tokenizer = load_tokenizer(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = []
    for dtype_name in dtypes:
        # fp32 master weights; bf16 is autocast, as in a training run (LocalEngine enters it)
        precision = "bf16" if dtype_name == "bf16-logits" else dtype_name
        fp32_lm_head = dtype_name == "bf16"  # a run's default; `generate` never enters it
        model = set_precision(load_causal_lm(model_dir), precision, fp32_lm_head)
        vllm = VLLMServer(str(model_dir), precision, args) if args.vllm_python else None
        for batch in batch_sizes:
            prompts = mixed_prompts(tokenizer, batch)
            runners = {"mileage": engine_run, "transformers": hf_run}
            if vllm is not None:
                runners["vllm"] = vllm
            for fn in runners.values():  # warm-up: allocator, kernel selection, lazy imports
                fn(model, tokenizer, prompts, 4, seed=0)
            wall = {k: [] for k in runners}
            cpu = {k: [] for k in runners}
            load_before = load_average()
            for rep in range(repeats):
                order = list(runners) if rep % 2 == 0 else list(reversed(runners))
                for key in order:
                    with Stopwatch() as sw:
                        runners[key](model, tokenizer, prompts, args.new_tokens, seed=rep)
                    wall[key].append(sw.wall)
                    cpu[key].append(sw.cpu)
                    print(
                        f"  {name} {dtype_name} batch {batch} {key}: {sw.wall:.2f}s "
                        f"({batch * args.new_tokens / sw.wall:.0f} tok/s)",
                        flush=True,
                    )
            tokens = batch * args.new_tokens
            row = {
                "model": name,
                "precision": dtype_name,
                "batch": batch,
                "new_tokens": args.new_tokens,
                "prompt_len": f"{min(map(len, prompts))}-{max(map(len, prompts))}",
                "load_before": load_before[0] if load_before else None,
                "load_after": (load_average() or [None])[0],
            }
            for key in runners:
                row[f"{key}_wall_s"] = wall[key]
                row[f"{key}_cpu_s"] = cpu[key]
                row[f"{key}_tok_s"] = tokens / median(wall[key])
                row[f"{key}_tok_s_range"] = spread([tokens / w for w in wall[key]])
                row[f"{key}_cpu_tok_s"] = tokens / median(cpu[key])
            row["speedup"] = row["mileage_tok_s"] / row["transformers_tok_s"]
            row["cpu_speedup"] = row["mileage_cpu_tok_s"] / row["transformers_cpu_tok_s"]
            rows.append(row)
        if vllm is not None:
            vllm.stop()
        del model
        gc.collect()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    out = output_path(args.out)  # before measuring, not after it
    import torch

    from mileage.models.hf import load_tokenizer  # noqa: F401  (offline, quiet HF)
    from mileage.rollout.builtin_model import ensure_builtin_model

    torch.set_num_threads(args.threads)
    info = machine_info(args.threads)
    info["matmul_gflops"] = matmul_limits(args.threads)
    print(f"machine: {info['cpu']}, {args.threads} torch threads, load {load_average()}")
    print(f"matmul limit (GFLOP/s by size): {info['matmul_gflops']}")
    rows = []
    if not args.skip_tiny:
        tiny = ensure_builtin_model("addition")
        rows += bench_model(
            "tiny-3.2M",
            tiny,
            args.dtypes.split(","),
            [int(b) for b in args.batch_sizes.split(",")],
            args,
            args.repeats,
        )
    if args.smollm2_dir:
        rows += bench_model(
            "SmolLM2-135M",
            args.smollm2_dir,
            args.smollm2_dtypes.split(","),
            [int(b) for b in args.smollm2_batch_sizes.split(",")],
            args,
            args.smollm2_repeats,
        )
    table = print_table(
        rows,
        [
            ("model", "model"),
            ("precision", "precision"),
            ("batch", "batch"),
            ("mileage_tok_s", "mileage tok/s"),
            ("mileage_tok_s_range", "(range)"),
            ("transformers_tok_s", "generate tok/s"),
            ("transformers_tok_s_range", "(range)"),
            ("vllm_tok_s", "vLLM tok/s"),
            ("vllm_tok_s_range", "(range)"),
            ("speedup", "speedup"),
            ("cpu_speedup", "speedup (CPU time)"),
            ("load_before", "load (1 min)"),
        ],
    )
    write_results(
        out,
        {
            "benchmark": "generation",
            "machine": info,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
