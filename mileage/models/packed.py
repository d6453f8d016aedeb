"""Generation's fp32 matmuls on weights reordered once per batch for oneDNN (CPU).

torch's stock fp32 CPU matmul repacks its weight operand on every call. At generation's shapes
(a decode step is a few to a few hundred rows against every weight of the model) that costs more
than the arithmetic: SmolLM2's 30 layers at 16 rows took 63 ms per step and its LM head 30 ms,
against 47 and 10.5 ms with each weight reordered once into oneDNN's blocked layout (AMD EPYC,
AVX2, 2 threads; `bench/profile_decode.py` has the engine's side). So inside `packed_weights()`,
which the engine enters once per batch, a `PackedLinear` multiplies by its weight reordered on
first use; the reordered copies live until the context ends, because the weights cannot change
inside a batch (the optimizer steps between batches, as autocast's own cast cache assumes).

Only plain fp32 CPU weights outside autocast take that path; everything else (bf16 autocast, a
GPU, FSDP's sharded parameters, a build without oneDNN) is `nn.Linear` as it was. Training never
enters the context, so the trainer's forward and backward are torch's own. The reordered product
rounds differently from the stock one (~1e-6), like any other kernel choice; prefill and every
decode step of a batch share it, so the engine's two decode paths stay bit-identical, and the
same host repeats it bit for bit. Each batch holds a second copy of the reordered weights
(SmolLM2: ~510 MB, less than its training step's gradients and optimizer state).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()  # generation may run in any thread (async driver, `mileage serve`)
# Smaller weights keep the stock path: they stay in cache, where repacking them per call is cheap
# and oneDNN was slower (SmolLM2's 576x192 K/V projections at 16 rows: 0.056-0.062 ms reordered
# against 0.045 stock; the built-in tiny model's generation, all of its weights under 1 MiB, took
# 0.129 s reordered against 0.117 s stock; AMD EPYC, AVX2, 2 threads).
MIN_BYTES = 1 << 20
# The row count oneDNN chooses the blocked layout for. 1 to 128 rows ran as fast on it as on a
# layout chosen for their own count (the LM head, AMD EPYC), so one layout serves every step.
_LAYOUT_ROWS = 16


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose fp32 forward, inside `packed_weights()`, runs on oneDNN with its
    weight reordered once per context; elsewhere it is `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
            packed = packed_weight(self)
            if packed is not None:
                return linear(x, packed, self.bias)
        return super().forward(x)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in fp32 with the weight as `packed_weight` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_weight(module: torch.nn.Linear) -> torch.Tensor | None:
    """`module`'s fp32 weight reordered for oneDNN's matmul, made on first use in the current
    `packed_weights()` context and kept until it ends; None outside one, or where the path does
    not apply (not a plain fp32 CPU tensor, under `MIN_BYTES`, a build without oneDNN)."""
    cache = getattr(_state, "cache", None)
    if cache is None:
        return None
    packed = cache.get(module)
    if packed is None:
        weight = module.weight
        if not (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and type(weight.data) is torch.Tensor  # not a DTensor or another subclass
            and weight.numel() * weight.element_size() >= MIN_BYTES
            and torch.backends.mkldnn.is_available()
        ):
            return None
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _LAYOUT_ROWS)
        cache[module] = packed
    return packed


@contextlib.contextmanager
def packed_weights(model: torch.nn.Module | None = None) -> Iterator[None]:
    """`PackedLinear`s (and the fp32 LM head) in this thread multiply by reordered weights until
    the context ends; their weights must not change inside it. Nested contexts share the
    outermost one's copies. Given a `model` with sharded (DTensor) parameters it does nothing:
    a reordered full copy on every rank would undo the sharding's memory saving."""
    outer = getattr(_state, "cache", None) is not None
    if not outer and (model is None or _plain_parameters(model)):
        _state.cache = {}
    try:
        yield
    finally:
        if not outer:
            _state.cache = None


def use_packed_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Make every plain `nn.Linear` in `model` a `PackedLinear`, in place: only the class
    changes, so parameters, their tying and the state dict stay as they are."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
    return model


def _plain_parameters(model: torch.nn.Module) -> bool:
    return all(type(p.data) is torch.Tensor for p in model.parameters())
