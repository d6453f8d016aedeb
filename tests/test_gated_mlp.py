"""`GatedSiLU`: the Llama MLP keeps one [tokens, intermediate] tensor fewer for the backward, and
its forward and gradients stay bit for bit those of the `transformers` module."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from mileage.models.gated_mlp import GatedSiLU, use_gated_silu

LAYERS, HIDDEN, INTERMEDIATE = 2, 32, 96


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _pass(model, ids, autocast: bool, saved: list | None = None):
    """Logits and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    hooks = contextlib.nullcontext()
    if saved is not None:

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), hooks:
        logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_gated_mlp_gives_the_transformers_modules_numbers_bit_for_bit(autocast):
    plain = _model()
    fused = copy.deepcopy(plain)
    assert use_gated_silu(fused) == LAYERS
    assert use_gated_silu(fused) == LAYERS  # applying it twice changes nothing
    assert fused.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    logits, grads = _pass(plain, ids, autocast)
    fused_logits, fused_grads = _pass(fused, ids, autocast)
    assert torch.equal(logits, fused_logits)
    different = [n for n, g in grads.items() if not torch.equal(g, fused_grads[n])]
    assert different == []
    # a copy (the critic's body, the generation copy) keeps the forward
    assert use_gated_silu(copy.deepcopy(fused)) == LAYERS


def test_the_gated_mlp_keeps_one_intermediate_tensor_fewer_per_layer():
    plain = _model()
    fused = copy.deepcopy(plain)
    use_gated_silu(fused)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    plain_saved, fused_saved = [], []
    _pass(plain, ids, False, plain_saved)
    _pass(fused, ids, False, fused_saved)
    one_tensor = ids.numel() * INTERMEDIATE * 4
    assert sum(plain_saved) - sum(fused_saved) == LAYERS * one_tensor


def test_gated_silus_gradients_are_the_derivatives():
    gate = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(GatedSiLU.apply, (gate, up))


def test_other_activations_keep_their_own_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, hidden_act="gelu",
    )  # fmt: skip
    assert use_gated_silu(LlamaForCausalLM(config)) == 0
