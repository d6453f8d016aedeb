"""`mileage_sdpa`: fp32 attention for bf16 models on a CPU, stock SDPA everywhere else."""

import json

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from mileage.models import attention
from mileage.precision import BF16, FP32, autocast, set_precision


def _qkv(dtype, gen):
    # GQA as in SmolLM2: 6 query heads share 2 key/value heads
    q = torch.randn(2, 6, 5, 16, generator=gen).to(dtype)
    k = torch.randn(2, 2, 5, 16, generator=gen).to(dtype)
    v = torch.randn(2, 2, 5, 16, generator=gen).to(dtype)
    return q, k, v


class _Module:  # what transformers' SDPA forward reads from an attention layer
    num_key_value_groups = 3
    is_causal = True


def test_bf16_attention_on_a_cpu_is_fp32_attention_rounded_once():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (t.requires_grad_() for t in _qkv(torch.bfloat16, gen))
    out, _ = attention._attention(_Module(), q, k, v, None, scaling=0.25)
    assert out.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=0.25, enable_gqa=True
    )
    assert torch.equal(out, want.transpose(1, 2).to(torch.bfloat16))
    stock = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert not torch.equal(out, stock.transpose(1, 2))  # so the test can tell the two apart
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16


def test_under_autocast_fp32_queries_are_not_rounded_to_bf16():
    # Llama's rotary embedding leaves queries and keys fp32 under autocast; stock SDPA would
    # round them (and the values) to bf16
    gen = torch.Generator().manual_seed(2)
    q, k, _ = _qkv(torch.float32, gen)
    v = torch.randn(2, 2, 5, 16, generator=gen).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention._attention(_Module(), q, k, v, None, scaling=0.25)
        stock = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    want = F.scaled_dot_product_attention(
        q, k, v.float(), is_causal=True, scale=0.25, enable_gqa=True
    )
    assert out.dtype == stock.dtype == torch.bfloat16
    assert torch.equal(out, want.transpose(1, 2).to(torch.bfloat16))
    assert not torch.equal(out, stock.transpose(1, 2))


def test_fp32_inputs_and_other_devices_take_stock_sdpa():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(torch.float32, gen)
    ours, _ = attention._attention(_Module(), q, k, v, None, scaling=0.25)
    stock = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert torch.equal(ours, stock.transpose(1, 2))
    assert not attention.upcast_on_cpu(torch.empty(1, dtype=torch.bfloat16, device="meta"))
    assert attention.upcast_on_cpu(torch.empty(1, dtype=torch.bfloat16))


def test_set_precision_switches_attention_and_the_saved_config_does_not_carry_it(
    tiny_hf, tmp_path, monkeypatch
):
    seen = []  # what our attention hands transformers' SDPA forward

    def spy(module, q, k, v, mask, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return stock_forward(module, q, k, v, mask, **kwargs)

    stock_forward = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    assert model.config._attn_implementation == "sdpa"
    set_precision(model, BF16)
    assert model.config._attn_implementation == attention.NAME
    ids = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad(), autocast(model):
        model(input_ids=ids, attention_mask=mask)
    fp32 = (torch.float32, torch.float32, torch.float32, False)
    assert seen == [fp32] * model.config.num_hidden_layers
    model.save_pretrained(tmp_path)
    assert attention.NAME not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    set_precision(model, FP32)
    assert model.config._attn_implementation == attention.VARLEN
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=mask)
    # fp32 (mileage_varlen) hands transformers' SDPA its inputs as they are: no upcast
    stock = (torch.float32, torch.float32, torch.bfloat16, True)
    assert (
        seen == [fp32] * model.config.num_hidden_layers + [stock] * model.config.num_hidden_layers
    )
    eager = AutoModelForCausalLM.from_pretrained(tiny_hf, attn_implementation="eager")
    set_precision(eager, BF16)
    assert eager.config._attn_implementation == "eager"
