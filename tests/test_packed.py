"""Generation's fp32 linears multiply by weights reordered once per batch for oneDNN
(`mileage.models.packed`): the same products as `nn.Linear` to rounding, made once per batch,
fresh after an optimizer step, scoped to the engine's context and thread, never under autocast
or on sharded parameters, and invisible to training and the checkpoint."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from mileage.models import packed
from mileage.models.packed import PackedLinear, packed_weights, use_packed_linears
from mileage.precision import BF16, FP32, generation_autocast, set_precision
from mileage.rollout.engine import LocalEngine, SamplingParams

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]]


@pytest.fixture(autouse=True)
def small_weights_too(monkeypatch, request) -> None:
    """The tiny test layers are under the size the path starts at; reorder them anyway."""
    if "threshold" not in request.node.name:
        monkeypatch.setattr(packed, "MIN_BYTES", 0)


@pytest.fixture
def reorders(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every weight reordered for oneDNN from now on."""
    seen: list[tuple[int, ...]] = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def counting(weight, rows):
        seen.append(tuple(weight.shape))
        return reorder(weight, rows)

    monkeypatch.setattr(packed.torch.ops.mkldnn, "_reorder_linear_weight", counting)
    return seen


def _linear(bias: bool = True) -> PackedLinear:
    torch.manual_seed(0)
    return use_packed_linears(torch.nn.Sequential(torch.nn.Linear(48, 40, bias=bias)))[0]


def test_outside_the_context_it_is_nn_linear_bit_for_bit(reorders):
    layer = _linear()
    x = torch.randn(5, 48)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert reorders == []


@pytest.mark.parametrize("bias", [True, False])
def test_inside_it_the_product_is_the_same_to_rounding_and_made_once(reorders, bias):
    layer = _linear(bias)
    x = torch.randn(16, 48)
    with torch.no_grad(), packed_weights():
        first = layer(x)
        assert torch.equal(layer(x[:3]), first[:3])  # other row counts share the one layout
        assert torch.equal(layer(x), first)
    assert reorders == [(40, 48)]
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_between_contexts_is_reordered_again(reorders):
    layer = _linear()
    x = torch.randn(4, 48)
    with torch.no_grad(), packed_weights():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an optimizer step between two batches
        layer.bias.mul_(2.0)
    with torch.no_grad(), packed_weights():
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
    assert len(reorders) == 2


def test_autocast_and_other_threads_take_the_stock_path(reorders):
    layer = _linear()
    x = torch.randn(4, 48)
    with torch.no_grad(), packed_weights():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16
        other: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: other.append(layer(x)))
        thread.start()
        thread.join(timeout=30)
        assert torch.equal(other[0], torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert reorders == []


def test_a_model_with_sharded_parameters_keeps_the_stock_path(reorders):
    class Sharded(torch.Tensor):  # stands in for FSDP's DTensor: a tensor subclass
        pass

    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 8))
    use_packed_linears(model)
    model[1].weight = torch.nn.Parameter(torch.Tensor._make_subclass(Sharded, model[1].weight))
    x = torch.randn(2, 48)
    with torch.no_grad(), packed_weights(model):
        model[0](x)
    assert reorders == []


def test_weights_under_the_threshold_keep_the_stock_path(reorders):
    small, large = torch.nn.Linear(256, 512), torch.nn.Linear(512, 512)  # 512 KiB, 1 MiB
    model = use_packed_linears(torch.nn.Sequential(small, large))
    with torch.no_grad(), packed_weights(model):
        model(torch.randn(4, 256))
    assert reorders == [(512, 512)]


def test_the_switch_keeps_parameters_tying_and_state_dict(tiny_hf):
    plain = AutoModelForCausalLM.from_pretrained(tiny_hf)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    plain.get_output_embeddings().weight = plain.get_input_embeddings().weight
    use_packed_linears(model)
    linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) > 4
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == len(linears)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    )
    assert isinstance(copy.deepcopy(model).lm_head, PackedLinear)  # old actor, generation copy


def test_the_engine_reorders_each_weight_once_per_batch_and_training_is_untouched(
    tiny_hf, reorders
):
    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf).eval(), FP32)
    plain = copy.deepcopy(model)
    engine = LocalEngine(model, pad_id=0, eos_id=2)
    out = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=8), torch.Generator().manual_seed(1)
    )
    assert max(len(c.response_ids) for c in out) > 3  # prefill and several decode steps ran
    matrices = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(reorders) == len(matrices)
    ids = torch.tensor([PROMPTS[2]])
    # a training forward, with autograd: torch's own kernels, so the trainer's bits are as before
    assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert len(reorders) == len(matrices)


def test_in_bf16_the_engine_reorders_only_the_fp32_head(tiny_hf, reorders):
    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf).eval(), BF16, True)
    LocalEngine(model, pad_id=0, eos_id=2).generate(
        PROMPTS, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(1)
    )
    assert reorders == [tuple(model.get_output_embeddings().weight.shape)]
    with torch.no_grad(), generation_autocast(model):  # the context the engine enters
        assert packed._state.cache == {}
    assert packed._state.cache is None


def test_reordered_generation_repeats_bit_for_bit_and_both_decode_paths_agree(
    tiny_hf, monkeypatch, reorders
):
    """What a resumed run relies on: a fresh batch reorders again and samples the same bits; the
    fast decoder and the stepped model agree exactly on reordered weights too."""
    from mileage.rollout.fast_decode import FastDecoder

    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf).eval(), FP32)
    engine = LocalEngine(model, pad_id=0, eos_id=2)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95)

    def sample() -> list[tuple[list[int], list[float]]]:
        out = engine.generate(PROMPTS * 3, params, torch.Generator().manual_seed(5))
        return [(c.response_ids, c.logprobs) for c in out]

    fast = sample()
    assert reorders, "the reordered path ran"
    assert sample() == fast
    monkeypatch.setattr(FastDecoder, "supports", staticmethod(lambda *a: False))
    assert sample() == fast
