"""The engine samples a bf16 model's tokens from fp32 logits (`mileage.models.lm_head`): the
head computes in fp32 during generation only, on the fast and the stepped decode paths, keeps its
parameters, tying and state dict, and `--no-fp32-lm-head` turns it off."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from mileage.cli.main import build_parser
from mileage.models import lm_head, packed
from mileage.models.lm_head import Fp32LogitsLinear, fp32_logits, use_fp32_logits
from mileage.precision import BF16, FP32, autocast, generation_autocast, set_precision
from mileage.rollout.engine import LocalEngine, SamplingParams
from mileage.rollout.fast_decode import FastDecoder
from mileage.run_config import RunConfig

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]]


def _model(tiny_hf, precision: str, fp32_lm_head: bool):
    model = AutoModelForCausalLM.from_pretrained(tiny_hf).eval()
    return set_precision(model, precision, fp32_lm_head)


def _logit_dtypes(model) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("fast", [True, False], ids=["fast-decode", "stepped"])
def test_bf16_generation_samples_from_fp32_logits_and_training_keeps_bf16(
    tiny_hf, monkeypatch, fast
):
    if not fast:
        monkeypatch.setattr(FastDecoder, "supports", staticmethod(lambda *a: False))
    model = _model(tiny_hf, BF16, fp32_lm_head=True)
    seen = _logit_dtypes(model)
    engine = LocalEngine(model, pad_id=0, eos_id=2)
    out = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(1)
    )
    assert max(len(c.response_ids) for c in out) > 2  # prefill and decode steps both ran
    assert seen and set(seen) == {torch.float32}, seen
    seen.clear()
    with autocast(model):  # a training forward: the bf16 head, as before
        model(input_ids=torch.tensor([PROMPTS[0]]))
    assert seen == [torch.bfloat16]


def test_fp32_logits_are_the_fp32_product_of_the_bf16_hidden_state(tiny_hf):
    model = _model(tiny_hf, BF16, fp32_lm_head=True)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad(), generation_autocast(model):
        out = model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    head = model.get_output_embeddings()
    expected = hidden.float() @ head.weight.t()
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad(), autocast(model):
        rounded = model(input_ids=ids).logits
    assert not torch.equal(rounded.float(), out.logits)  # bf16 rounding is really gone


@pytest.mark.parametrize(
    ("precision", "fp32_lm_head", "switched"),
    [(BF16, True, True), (BF16, False, False), (FP32, True, False)],
    ids=["bf16", "bf16-off", "fp32"],
)
def test_only_a_bf16_model_asked_for_it_switches_and_nothing_else_changes(
    tiny_hf, precision, fp32_lm_head, switched
):
    plain = AutoModelForCausalLM.from_pretrained(tiny_hf)
    model = _model(tiny_hf, precision, fp32_lm_head)
    head = model.get_output_embeddings()
    assert isinstance(head, Fp32LogitsLinear) == switched
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    )
    if switched:  # a deep copy (old actor, generation copy) keeps the switch; it can be undone
        assert isinstance(copy.deepcopy(model).get_output_embeddings(), Fp32LogitsLinear)
        set_precision(model, BF16, fp32_lm_head=False)
        assert type(model.get_output_embeddings()) is torch.nn.Linear


def test_a_tied_head_keeps_its_tie(tiny_hf):
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    assert use_fp32_logits(model, True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_head_that_is_not_a_plain_linear_is_left_alone():
    class Wrapped(torch.nn.Linear):
        pass

    model = torch.nn.Module()
    model.get_output_embeddings = lambda: head
    head = Wrapped(4, 3)
    assert not use_fp32_logits(model, True)
    assert type(head) is Wrapped


def test_the_switch_is_scoped_to_its_thread_and_context(tiny_hf):
    head = _model(tiny_hf, BF16, fp32_lm_head=True).get_output_embeddings()
    x = torch.randn(2, head.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head(x).dtype == torch.bfloat16
        with fp32_logits():
            assert head(x).dtype == torch.float32
        assert head(x).dtype == torch.bfloat16


def test_the_heads_packed_weight_is_made_once_per_context_and_sees_a_changed_weight(
    tiny_hf, monkeypatch
):
    monkeypatch.setattr(packed, "MIN_BYTES", 0)  # the tiny head is under the size it starts at
    head = _model(tiny_hf, BF16, fp32_lm_head=True).get_output_embeddings()
    reorders = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(
        lm_head.torch.ops.mkldnn,
        "_reorder_linear_weight",
        lambda w, rows: reorders.append(rows) or reorder(w, rows),
    )
    x = torch.randn(3, head.in_features)
    with fp32_logits():
        first = head(x)
        assert torch.equal(head(x[:1]), first[:1])  # other row counts reuse it
    assert len(reorders) == 1
    torch.testing.assert_close(first, x @ head.weight.t(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        head.weight.mul_(2.0)  # an optimizer step between two batches
    with fp32_logits():
        torch.testing.assert_close(head(x), 2 * first, rtol=1e-6, atol=1e-6)
    assert len(reorders) == 2


def test_the_flag_defaults_on_and_no_fp32_lm_head_turns_it_off():
    parse = build_parser().parse_args
    assert RunConfig.from_args(parse(["train"])).precision.fp32_lm_head is True
    off = RunConfig.from_args(parse(["train", "--no-fp32-lm-head"]))
    assert off.precision.fp32_lm_head is False


@pytest.mark.parametrize("flag", [[], ["--no-fp32-lm-head"]], ids=["default", "off"])
def test_a_bf16_run_builds_its_policy_with_the_switch_and_says_so(tiny_hf, tmp_path, flag):
    from conftest import fast_train_args

    from mileage.components import build_run
    from mileage.preflight import preflight

    args = fast_train_args(tiny_hf, "--precision", "bf16", "--save", str(tmp_path), *flag)
    cfg = RunConfig.from_args(build_parser().parse_args(["train", *args]))
    plan = preflight(cfg)
    run = build_run(cfg, plan, lambda *_: None)
    on = not flag
    assert isinstance(run.model.get_output_embeddings(), Fp32LogitsLinear) == on
    # and its MLPs keep one activation fewer (mileage.models.gated_mlp)
    mlps = [m for m in run.model.modules() if type(m).__name__ == "LlamaMLP"]
    assert mlps and all(getattr(type(m), "_mileage_gated_silu", False) for m in mlps)
    logits = "fp32" if on else "bf16 (--no-fp32-lm-head)"
    assert f"the engine samples from {logits} logits" in plan.plan.describe()
