"""Packed against padded micro-batches on a device: log-probs and gradients, and which attention
kernel the packed forward took.

    python scripts/gpu_packing.py --device cuda     # scripts/gpu_check.sh runs this
    python scripts/gpu_packing.py --device cpu      # what the suite checks the script with

The built-in model in `--precision`, a batch of 8 samples with prompts and responses of other
lengths, one padded forward and backward against one packed (`mileage.training.packing`). Exits
1 with one line when the log-probs or gradients differ beyond bf16/fp32 rounding, or when
`--device cuda` did not run on the GPU; prints which attention the packed forward used
(flash-attention's varlen kernel, where `flash_attn` is installed on a GPU, or one SDPA call per
sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from mileage.models.attention import _flash_varlen_available
    from mileage.precision import set_precision
    from mileage.rollout.builtin_model import ensure_builtin_model
    from mileage.training.actor import sequence_logprobs
    from mileage.training.batch import TrainBatch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_packing: CUDA is not available", file=sys.stderr)
        return 1
    model = AutoModelForCausalLM.from_pretrained(ensure_builtin_model("addition")).to(device)
    model = set_precision(model, args.precision).train()
    g = torch.Generator().manual_seed(0)
    lengths = [(4, 3), (7, 12), (4, 1), (5, 20), (7, 6), (4, 2), (6, 9), (5, 15)]
    width = max(p + r for p, r in lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((len(lengths), width - 1))
    for row, (prompt, response) in enumerate(lengths):
        ids[row, : prompt + response] = torch.randint(
            3, model.config.vocab_size, (prompt + response,), generator=g
        )
        attention[row, : prompt + response] = 1
        mask[row, prompt - 1 : prompt + response - 1] = 1
    batch = TrainBatch(
        ids, attention, mask, torch.zeros_like(mask), torch.zeros(len(lengths)),
        prompt_lens=torch.tensor([p for p, _ in lengths]),
    ).to(device)  # fmt: skip
    whole = batch.slice(0, len(batch))

    def run(part: TrainBatch):
        model.zero_grad(set_to_none=True)
        logp, _ = sequence_logprobs(model, part, 1.0)
        (-(logp * part.loss_mask).sum() / part.loss_mask.sum()).backward()
        grads = torch.cat(
            [p.grad.flatten().float() for p in model.parameters() if p.grad is not None]
        )
        return (logp * part.loss_mask).detach().float(), grads

    padded = run(dataclasses.replace(whole, prompt_lens=None))
    packed = run(dataclasses.replace(whole, packed=True))
    on = {p.device.type for p in model.parameters()}
    logp_diff = float((packed[0] - padded[0]).abs().max())
    grad_error = float((packed[1] - padded[1]).norm() / padded[1].norm())
    kernel = (
        "flash-attention varlen"
        if device.type == "cuda" and _flash_varlen_available()
        else "one SDPA call per sample"
    )
    tolerance = (5e-2, 5e-2) if args.precision == "bf16" else (1e-4, 1e-4)
    print(
        f"packing on {device} ({args.precision}, {kernel}): log-prob max |diff| {logp_diff:.2e}, "
        f"gradient relative error {grad_error:.2e} against padded"
    )
    if on != {device.type}:
        print(f"gpu_packing: the model ran on {sorted(on)}, not {device.type}", file=sys.stderr)
        return 1
    if logp_diff > tolerance[0] or grad_error > tolerance[1]:
        print(f"gpu_packing: packed differs from padded beyond {tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
