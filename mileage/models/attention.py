"""`mileage_sdpa`: transformers' SDPA attention, computed in fp32 when a bf16 model runs on a CPU.

Under bf16 autocast, Llama's rotary embedding leaves queries and keys in fp32 and the values come
out of their projection in bf16; stock SDPA rounds all three to bf16. On a CPU, torch's bf16
flash-attention backward is several times slower than its fp32 one at RL shapes (36-50 against
12-15 ms for one SmolLM2 layer at 64 x 38 tokens on an AVX-512 EPYC, measured alone), while
attention is a few percent of a layer's FLOPs. So on a CPU the scores, softmax and weighted sum
run in fp32 (the values upcast exactly), and the output is rounded to bf16 for the output
projection. That is also more exact than bf16 attention. The training forward, the engine's
prefill and `FastDecoder`'s steps all compute it the same way.

On a GPU, and for fp32 models (`mileage_varlen`), it is transformers' SDPA attention unchanged,
except in a packed forward (`mileage.training.packing`: one row of several samples, with transformers' varlen
arguments `cu_seq_lens_q`/`cu_seq_lens_k`): there each sample's causal attention runs on its own,
through flash-attention's varlen kernel on a GPU where the `flash_attn` package is installed,
else one SDPA call per sample. transformers' own packed path would run one SDPA over the whole
row under a block-diagonal mask: the same values, but scores for every pair of samples.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mileage_sdpa"
VARLEN = "mileage_varlen"  # fp32 models: stock SDPA, but one packed sequence at a time
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


def _packed(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The packed sequences' bounds of a packed forward (one row, no cache), else None."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        return bounds
    return None


def _attention(module, query, key, value, attention_mask, **kwargs):
    bounds = _packed(query, key, kwargs)
    if bounds is not None:
        return _varlen(_upcast, module, query, key, value, bounds, **kwargs)
    return _upcast(module, query, key, value, attention_mask, **kwargs)


def _stock(module, query, key, value, attention_mask, **kwargs):
    bounds = _packed(query, key, kwargs)
    if bounds is not None:
        return _varlen(sdpa_attention_forward, module, query, key, value, bounds, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _upcast(module, query, key, value, attention_mask, **kwargs):
    if not upcast_on_cpu(query, key, value):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = output_dtype(query)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


def _varlen(attend, module, query, key, value, bounds: torch.Tensor, **kwargs):
    """Causal attention within each packed sequence [bounds[i], bounds[i+1]) of the row, by
    `attend` one sequence at a time, or by flash-attention's varlen kernel on a GPU."""
    if query.is_cuda and _flash_varlen_available():
        from transformers.integrations.flash_attention import flash_attention_forward

        return flash_attention_forward(module, query, key, value, None, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS}
    edges = bounds.tolist()
    outs = [
        attend(
            module, *(t[:, :, a:b] for t in (query, key, value)), None, is_causal=True, **kwargs
        )[0]
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    return torch.cat(outs, dim=1), None  # [1, tokens, heads, head_dim], as SDPA's output


_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal")


def _flash_varlen_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(VARLEN, _stock)
AttentionMaskInterface.register(VARLEN, sdpa_mask)
OURS = ("sdpa", NAME, VARLEN)


def use_mileage_attention(model: torch.nn.Module, bf16: bool) -> None:
    """Switch the SDPA attention of every transformers model inside `model` to `mileage_sdpa`
    (`bf16`) or `mileage_varlen` (stock SDPA but in packed forwards). Models with another
    attention implementation are left as they are."""
    wanted = NAME if bf16 else VARLEN
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation in OURS:
            module.set_attn_implementation(wanted)
