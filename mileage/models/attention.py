"""`mileage_sdpa`: transformers' SDPA attention, computed in fp32 when a bf16 model runs on a CPU.

Under bf16 autocast, Llama's rotary embedding leaves queries and keys in fp32 and the values come
out of their projection in bf16; stock SDPA rounds all three to bf16. On a CPU, torch's bf16
flash-attention backward is several times slower than its fp32 one at RL shapes (36-50 against
12-15 ms for one SmolLM2 layer at 64 x 38 tokens on an AVX-512 EPYC, measured alone), while
attention is a few percent of a layer's FLOPs. So on a CPU the scores, softmax and weighted sum
run in fp32 (the values upcast exactly), and the output is rounded to bf16 for the output
projection. That is also more exact than bf16 attention. The training forward, the engine's
prefill and `FastDecoder`'s steps all compute it the same way.

On a GPU, and for fp32 models, it is transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mileage_sdpa"
_REDUCED = (torch.bfloat16, torch.float16)


def upcast_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether attention over `tensors` (query, key, value) runs in fp32 rather than as SDPA
    would run it: on a CPU, under reduced-precision autocast or with any reduced-precision
    input. (Llama's rotary embedding already promotes queries and keys to fp32 under autocast;
    stock SDPA would round them back to bf16.)"""
    if tensors[0].device.type != "cpu":
        return False
    return torch.is_autocast_enabled("cpu") or any(t.dtype in _REDUCED for t in tensors)


def output_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype stock SDPA would return: autocast's, else the query's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype


def _attention(module, query, key, value, attention_mask, **kwargs):
    if not upcast_on_cpu(query, key, value):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = output_dtype(query)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_mileage_attention(model: torch.nn.Module, enabled: bool) -> None:
    """Switch the SDPA attention of every transformers model inside `model` to `mileage_sdpa`
    (or back). Models with another attention implementation are left as they are."""
    current, wanted = ("sdpa", NAME) if enabled else (NAME, "sdpa")
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation == current:
            module.set_attn_implementation(wanted)
