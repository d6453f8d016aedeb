"""The in-process engine: determinism, EOS handling, top-p, and log-probs that match training."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mileage.precision import BF16, FP32, set_precision
from mileage.rollout.engine import LocalEngine, SamplingParams, sample_tokens
from mileage.training.actor import sequence_logprobs
from mileage.training.batch import pack_samples


def engine_for(tiny_hf):
    model = AutoModelForCausalLM.from_pretrained(tiny_hf).eval()
    return LocalEngine(model, pad_id=0, eos_id=2), model


PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]]


class _Scored:  # the fields pack_samples reads
    def __init__(self, c):
        self.prompt_ids, self.response_ids, self.logprobs = c.prompt_ids, c.response_ids, c.logprobs
        self.reward = 0.0

    def mask(self) -> list[int]:
        return [1] * len(self.response_ids)


def test_same_generator_seed_same_samples(tiny_hf):
    engine, _ = engine_for(tiny_hf)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    first = engine.generate(PROMPTS, params, torch.Generator().manual_seed(3))
    second = engine.generate(PROMPTS, params, torch.Generator().manual_seed(3))
    other = engine.generate(PROMPTS, params, torch.Generator().manual_seed(4))
    assert [c.response_ids for c in first] == [c.response_ids for c in second]
    assert [c.logprobs for c in first] == [c.logprobs for c in second]
    assert [c.response_ids for c in first] != [c.response_ids for c in other]


@pytest.mark.parametrize("precision", [FP32, BF16])
def test_the_fast_decoder_is_bit_identical_to_stepping_the_transformers_model(
    tiny_hf, monkeypatch, precision
):
    from mileage.rollout.fast_decode import FastDecoder

    engine, model = engine_for(tiny_hf)
    set_precision(model, precision)  # bf16: mileage_sdpa, fp32 attention on this CPU
    assert FastDecoder.supports(model, 64), "the tiny Llama should take the fast path"
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95)
    fast = engine.generate(PROMPTS * 3, params, torch.Generator().manual_seed(5))
    monkeypatch.setattr(FastDecoder, "supports", staticmethod(lambda *a: False))
    slow = engine.generate(PROMPTS * 3, params, torch.Generator().manual_seed(5))
    assert [c.response_ids for c in fast] == [c.response_ids for c in slow]
    assert [c.logprobs for c in fast] == [c.logprobs for c in slow]  # exactly, not approximately


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_generation_rounds_each_weight_once_per_batch_not_per_token(
    tiny_hf, monkeypatch, fast
):
    """autocast caches its fp32 -> bf16 weight casts only outside inference mode; inside it
    every decode step copied every weight again (39 % of SmolLM2's bf16 generation)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mileage.rollout.fast_decode import FastDecoder

    if not fast:
        monkeypatch.setattr(FastDecoder, "supports", staticmethod(lambda *a: False))
    engine, model = engine_for(tiny_hf)
    set_precision(model, BF16)
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    casts: list[tuple[int, ...]] = []

    class CountWeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            source = args[0] if args else None
            # autocast casts through _to_copy, or (in inference mode) through to.dtype
            target = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            if (
                func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)
                and target == torch.bfloat16
                and isinstance(source, torch.Tensor)
                and source.dtype == torch.float32
                and tuple(source.shape) in weight_shapes
            ):
                casts.append(tuple(source.shape))
            return func(*args, **kwargs)

    params = SamplingParams(max_new_tokens=10)
    with CountWeightCasts():
        out = engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    assert max(len(c.response_ids) for c in out) > 3  # several decode steps ran
    matrices = sum(1 for p in model.parameters() if p.dim() == 2)
    assert 0 < len(casts) <= matrices, f"{len(casts)} weight casts for {matrices} matrices"


def test_rows_stop_at_eos_and_respect_the_length_limit(tiny_hf):
    engine, _ = engine_for(tiny_hf)
    out = engine.generate(
        PROMPTS * 8, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0)
    )
    for c in out:
        assert 1 <= len(c.response_ids) <= 6 and len(c.logprobs) == len(c.response_ids)
        assert c.finished == (c.response_ids[-1] == 2) and 2 not in c.response_ids[:-1]


def test_recorded_logprobs_equal_the_trainers(tiny_hf):
    """Left-padded cached decoding and right-padded full forward agree, so ratio starts at 1."""
    engine, model = engine_for(tiny_hf)
    params = SamplingParams(max_new_tokens=10, temperature=0.7)
    completions = engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))

    batch = pack_samples([_Scored(c) for c in completions], pad_id=0)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, temperature=0.7)
    mask = batch.loss_mask.bool()
    assert torch.allclose(logp[mask], batch.old_logprobs[mask], atol=1e-4)


def test_repeated_prompts_share_one_prefill_row_and_keep_their_own_samples(tiny_hf):
    """GRPO sends each prompt n times: the prefill runs once per distinct prompt, and each
    sample continues from its own prompt's row (log-probs as the trainer scores them)."""
    engine, model = engine_for(tiny_hf)
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    prefill_rows = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape),
        with_kwargs=True,
    )
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    completions = engine.generate(prompts, params, torch.Generator().manual_seed(2))
    hook.remove()
    assert prefill_rows[0] == (3, len(PROMPTS[2]))  # the fast decoder took every later step
    assert [c.prompt_ids for c in completions] == prompts
    assert len({tuple(c.response_ids) for c in completions}) > 3  # samples still differ
    batch = pack_samples([_Scored(c) for c in completions], pad_id=0)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, temperature=1.0)
    mask = batch.loss_mask.bool()
    assert torch.allclose(logp[mask], batch.old_logprobs[mask], atol=1e-4)


def test_greedy_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]])
    tokens, logp = sample_tokens(logits, SamplingParams(1, temperature=0.0), None)
    assert tokens.item() == 1 and logp.item() == torch.log_softmax(logits, -1)[0, 1].item()
    gen = torch.Generator().manual_seed(0)
    picks = {
        sample_tokens(logits, SamplingParams(1, 1.0, top_p=0.5), gen)[0].item() for _ in range(50)
    }
    assert picks == {1}  # token 1 alone already holds >= half the mass
    picks = {
        sample_tokens(logits, SamplingParams(1, 1.0, top_p=0.9), gen)[0].item() for _ in range(200)
    }
    assert picks == {1, 2}
