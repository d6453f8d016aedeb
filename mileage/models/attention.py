"""`mileage_sdpa`: transformers' SDPA attention, computed in fp32 when a bf16 model runs on a CPU.

Under bf16 autocast the projections hand attention bf16 queries, keys and values. On a CPU,
torch's bf16 flash-attention backward is several times slower than its fp32 one at RL shapes
(44 against 9 ms per SmolLM2 layer for 64 x 38 tokens on an AVX-512 EPYC), while the attention
matmuls are a few percent of a layer's FLOPs. So on a CPU the scores, softmax and weighted sum
run in fp32 from the (exactly upcast) bf16 inputs, and the output is rounded back to bf16 for
the output projection. This is also more exact than bf16 attention, and the training forward,
the engine's prefill and `FastDecoder`'s steps all compute it the same way.

On a GPU, and for fp32 inputs, it is transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mileage_sdpa"


def upcast_on_cpu(query: torch.Tensor) -> bool:
    """Whether attention over `query` runs in fp32 rather than in its own dtype."""
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def _attention(module, query, key, value, attention_mask, **kwargs):
    if not upcast_on_cpu(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(query.dtype), weights


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_mileage_attention(model: torch.nn.Module, enabled: bool) -> None:
    """Switch the SDPA attention of every transformers model inside `model` to `mileage_sdpa`
    (or back). Models with another attention implementation are left as they are."""
    current, wanted = ("sdpa", NAME) if enabled else (NAME, "sdpa")
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation == current:
            module.set_attn_implementation(wanted)
