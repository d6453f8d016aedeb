"""`FastDecoder`: one decode step of a Llama-family model (Llama, Mistral, Qwen2 with SDPA
attention, or its `mileage_sdpa` form) against a preallocated KV cache, op for op the
arithmetic of the `transformers` model, so its tokens and log-probs are bit-identical to
stepping that model. It skips what
costs time there: regrowing the cache by concatenation every step, rebuilding masks and rotary
tables, generic per-call Python. `LocalEngine` uses it when `FastDecoder.supports` the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mileage.models import attention

# Model types whose decoder layer is Llama's (pre-norm RMSNorm, rotary attention, SiLU-gated MLP).
FAST_DECODE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm's arithmetic: normalise in fp32, cast back, then scale
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class FastDecoder:
    """One-token decode steps of a Llama-family model against a preallocated KV cache.

    It reads the model's own parameters at every step (nothing is copied), so weights the
    trainer updates in place are live immediately, as with the `transformers` forward.
    """

    def __init__(self, model: torch.nn.Module, batch: int, total_len: int):
        core = model.model
        attn = core.layers[0].self_attn
        self.model = model
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.batch = batch
        self.layers = core.layers
        self.embed = core.embed_tokens.weight
        self.norm = core.norm
        self.lm_head = model.lm_head
        self.mileage_attention = model.config._attn_implementation == attention.NAME
        shape = (batch, self.kv_heads, total_len, self.head_dim)
        self.keys = [self.embed.new_empty(shape) for _ in self.layers]
        self.values = [self.embed.new_empty(shape) for _ in self.layers]

    @staticmethod
    def supports(model: torch.nn.Module, total_len: int) -> bool:
        """Whether `model` is a Llama-family LM this decoder reproduces exactly."""
        config = getattr(model, "config", None)
        if config is None or getattr(config, "model_type", None) not in FAST_DECODE_MODEL_TYPES:
            return False
        if getattr(config, "_attn_implementation", None) not in attention.OURS:
            return False  # eager/flash attention round differently; keep the model's own kernels
        if getattr(config, "hidden_act", None) != "silu":
            return False
        if model.training and getattr(config, "attention_dropout", 0.0):
            return False
        window = getattr(config, "sliding_window", None)
        if (
            window is not None
            and getattr(config, "use_sliding_window", True)
            and total_len > window
        ):
            return False
        core = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        return (
            core is not None
            and all(hasattr(core, name) for name in needed)
            and len(core.layers) > 0
            and isinstance(getattr(model, "lm_head", None), torch.nn.Linear)
        )

    def load_prefill(self, cache: DynamicCache, width: int) -> None:
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            keys[:, :, :width] = layer.keys
            values[:, :, :width] = layer.values

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x*cos + rotate_half(x)*sin, with the sign of rotate_half folded into `sin`
        half = self.head_dim // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin

    def _attend(self, q, k, v, mask, extra) -> torch.Tensor:
        if not (self.mileage_attention and attention.upcast_on_cpu(q, k, v)):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling, is_causal=False, **extra
            )
        # mileage_sdpa's arithmetic: fp32 throughout, rounded to autocast's dtype after
        dtype = attention.output_dtype(q)
        with torch.autocast("cpu", enabled=False):
            o = F.scaled_dot_product_attention(
                q.float(),
                k.float(),
                v.float(),
                attn_mask=mask,
                dropout_p=0.0,
                scale=self.scaling,
                is_causal=False,
                **extra,
            )
        return o.to(dtype)

    def step(
        self,
        tokens: torch.Tensor,
        index: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logits [B, V] after feeding `tokens` [B] at cache slot `index`.

        `cos`/`sin` are [B, 1, 1, D] for this step, `sin` with its first half negated so that
        rotate_half becomes a plain swap of halves (negation is exact, so the bits are unchanged).
        `mask` is the [B, 1, 1, index + 1] padding mask, or None when no prompt is padded.
        """
        batch, heads, kv_heads, dim = self.batch, self.heads, self.kv_heads, self.head_dim
        h = F.embedding(tokens[:, None], self.embed)  # [B, 1, hidden]
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            x = _rms_norm(h, norm.weight, norm.variance_epsilon)
            q = self._rope(attn.q_proj(x).view(batch, 1, heads, dim), cos, sin)
            keys[:, :, index] = self._rope(
                attn.k_proj(x).view(batch, kv_heads, dim), cos[:, 0], sin[:, 0]
            )
            values[:, :, index] = attn.v_proj(x).view(batch, kv_heads, dim)
            k, v = keys[:, :, : index + 1], values[:, :, : index + 1]
            q = q.transpose(1, 2)  # [B, H, 1, D]
            extra = {}
            if self.groups > 1:
                if mask is None:
                    extra["enable_gqa"] = True
                else:
                    # the query heads sharing a KV head become its query rows (transformers'
                    # pack_gqa), so K/V are never repeated
                    q = q.reshape(batch, kv_heads, self.groups, dim)
            o = self._attend(q, k, v, mask, extra)
            o = o.reshape(batch, heads, 1, dim).transpose(1, 2).reshape(batch, 1, heads * dim)
            h = h + attn.o_proj(o)
            norm = layer.post_attention_layernorm
            x = _rms_norm(h, norm.weight, norm.variance_epsilon)
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        h = _rms_norm(h, self.norm.weight, self.norm.variance_epsilon)
        return self.lm_head(h)[:, -1]
