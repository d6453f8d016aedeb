"""The SiLU-gated MLP of Llama-family models, `down(silu(gate(x)) * up(x))`, keeping one tensor
fewer for the backward.

Autograd keeps three [tokens, intermediate] tensors between `gate`/`up` and `down`: the gate's
output (for SiLU's derivative), SiLU's output and the up projection's output (for the product's).
`GatedSiLU` keeps the first and the last and computes SiLU again in the backward: 1,536 floats
less per token and layer for SmolLM2 (its fp32 training pass of 4x4 rows: 1,359 -> 1,246 MiB of
activations, docs/benchmarks.md §1), for one more elementwise pass. It runs autograd's own
operations in autograd's order, so the forward and every gradient are bit for bit those of the
`transformers` module (a test holds it to that in fp32 and under bf16 autocast), and runs saved
before keep resuming exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# MLP classes whose forward is exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))`
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class GatedSiLU(torch.autograd.Function):
    """silu(gate) * up, saving gate and up only (SiLU's output is recomputed)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        # autograd's own formulas: the product's (grad * other) and SiLU's (silu_backward)
        grad_up = grad * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(GatedSiLU.apply(self.gate_proj(x), self.up_proj(x)))


def _is_silu(module: torch.nn.Module) -> bool:
    from transformers.activations import SiLUActivation

    return type(module) in (torch.nn.SiLU, SiLUActivation)


def use_gated_silu(model: torch.nn.Module) -> int:
    """Give every SiLU-gated MLP inside `model` (its class in `GATED_MLP_CLASSES`) the forward
    above, by swapping its class for a subclass, so that copies, state dicts and FSDP2 see the
    same module. Returns how many MLPs now use it; other models are left as they are."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if getattr(cls, "_mileage_gated_silu", False):
            count += 1
            continue
        if cls.__name__ not in GATED_MLP_CLASSES or not _is_silu(getattr(module, "act_fn", None)):
            continue
        module.__class__ = _fused_class(cls)
        count += 1
    return count


_FUSED: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    if cls not in _FUSED:
        _FUSED[cls] = type(cls.__name__, (cls,), {"forward": _forward, "_mileage_gated_silu": True})
    return _FUSED[cls]
