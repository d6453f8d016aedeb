"""Compute precision: fp32 everywhere, or bf16 compute over fp32 master weights.

`--precision auto` (the default) picks bf16 only where the hardware computes it natively: a CUDA
GPU with bf16, or a CPU with AMX (`amx_bf16`) or AVX512-BF16 (`avx512_bf16`). A CPU without
them (AVX2 only) emulates bf16 matmuls and is slower with them than in fp32, so `auto` keeps
fp32 there. `--bf16` is miles'/Megatron's switch and means `--precision bf16`.

In bf16 the parameters, gradients and optimizer state stay fp32 (master weights); each forward
(and so its backward) and each generation step runs under `torch.autocast` in bf16, which rounds
the matmul inputs to bf16 and keeps reductions such as log-softmax and RMSNorm in fp32 (on a
CPU, attention too: `mileage.models.attention`), and the engine samples from fp32 logits
(`mileage.models.lm_head`; `--no-fp32-lm-head` rounds them to bf16). A model carries its
precision as an attribute (`set_precision`), so every code path that runs it (training,
reference, critic, the in-process engine, `mileage serve`) enters the same context through
`autocast(model)` (the engine: `generation_autocast`), in any thread, and a deep copy keeps it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mileage.config import option
from mileage.errors import UserError

FP32, BF16 = "fp32", "bf16"
CHOICES = ("auto", FP32, BF16)
# /proc/cpuinfo flags of CPUs that compute bf16 dot products in hardware
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
_ATTR = "mileage_precision"


@dataclass
class PrecisionConfig:
    precision: str = option(
        "auto",
        "compute precision: auto (bf16 where the CPU/GPU does bf16 natively, else fp32), fp32 "
        "or bf16; parameters, gradients and optimizer state stay fp32",
        choices=CHOICES,
    )
    bf16: bool = option(False, "miles/Megatron's switch: the same as --precision bf16")
    fp32_lm_head: bool = option(
        True,
        "in bf16, sample from logits rounded to bf16 instead of computing the engine's LM head "
        "in fp32 (faster generation; the demo's accuracy then has a bad tail across seeds)",
        flag="--no-fp32-lm-head",
    )

    def requested(self) -> str:
        if self.bf16 and self.precision == FP32:
            raise UserError("--bf16 and --precision fp32 contradict each other; give one")
        return BF16 if self.bf16 else self.precision


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The feature flags the kernel reports for the first CPU (empty where it has no cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and the evidence in words."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"GPU {torch.cuda.get_device_name(device)} {'has' if ok else 'lacks'} bf16"
    found = sorted(set(NATIVE_BF16_CPU_FLAGS) & cpu_flags())
    if found:
        return True, f"the CPU has {' and '.join(found)}"
    return False, f"the CPU has none of {', '.join(NATIVE_BF16_CPU_FLAGS)} (bf16 would be emulated)"


def resolve(requested: str, device: torch.device) -> tuple[str, str]:
    """The precision a run computes in (fp32 or bf16) and a line saying why."""
    if requested not in CHOICES:
        raise UserError(f"precision must be one of {', '.join(CHOICES)}, got {requested!r}")
    if requested != "auto":
        return requested, "as asked"
    native, why = native_bf16(device)
    chosen = BF16 if native else FP32
    return chosen, f"auto: {why}"


def set_precision(
    model: torch.nn.Module, precision: str, fp32_lm_head: bool = False
) -> torch.nn.Module:
    """Mark `model` to run its forwards (and generation) in `precision`; a transformers model's
    SDPA attention becomes `mileage_sdpa` (bf16: fp32 attention on a CPU) or `mileage_varlen`
    (fp32: stock SDPA), both running packed forwards one sample at a time, and, in bf16 with
    `fp32_lm_head`, generation samples from fp32 logits (`mileage.models.lm_head`)."""
    if precision not in (FP32, BF16):
        raise ValueError(f"not a resolved precision: {precision!r}")
    from mileage.models.attention import use_mileage_attention
    from mileage.models.lm_head import use_fp32_logits

    setattr(model, _ATTR, precision)
    use_mileage_attention(model, precision == BF16)
    use_fp32_logits(model, precision == BF16 and fp32_lm_head)
    return model


def precision_of(model: torch.nn.Module) -> str:
    return getattr(model, _ATTR, FP32)


def autocast(model: torch.nn.Module, cache_casts: bool = True) -> contextlib.AbstractContextManager:
    """The context a forward of `model` runs in: bf16 autocast on its device, or nothing.
    `cache_casts=False` rounds a weight to bf16 at each use rather than once per context (see
    `mileage.training.shared_prompt`)."""
    if precision_of(model) != BF16:
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache_casts)


def generation_autocast(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The context the engine generates in: `autocast(model)`, fp32 weights reordered once for
    oneDNN (`mileage.models.packed`), and fp32 logits where the model's LM head was switched to
    them (`set_precision(..., fp32_lm_head=True)`)."""
    from mileage.models.lm_head import fp32_logits, has_fp32_logits
    from mileage.models.packed import packed_weights

    stack = contextlib.ExitStack()
    stack.enter_context(autocast(model))
    stack.enter_context(packed_weights(model))
    if has_fp32_logits(model):
        stack.enter_context(fp32_logits())
    return stack


def torch_dtype_name(precision: str) -> str:
    """The `--dtype` spelling of vLLM and `mileage serve` for a resolved precision."""
    return {FP32: "float32", BF16: "bfloat16"}[precision]
