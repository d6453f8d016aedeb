"""`--log-probs-chunk-size`: the LM head and the log-probs a chunk of tokens at a time
(`mileage.training.logprobs.head_logprobs`) give the unchunked values and gradients, on every
path the trainer takes (plain forward, shared prompts, bf16, LoRA), and never hold a batch's
logits whole."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mileage.errors import UserError
from mileage.models.lm_head import HiddenHead, hidden_head
from mileage.precision import BF16, FP32, set_precision
from mileage.training import logprobs
from mileage.training.actor import sequence_logprobs
from mileage.training.algo import LOGITS_CHUNK_BYTES, AlgoConfig
from mileage.training.batch import TrainBatch
from mileage.training.logprobs import head_logprobs, token_logprobs

# chunked matmuls have fewer rows than the whole one and may sum in another order
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _batch(vocab: int, prompts: int = 3, samples: int = 4, shared: bool = True) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    rows, prompt_lens = [], []
    for p in range(prompts):
        prompt = torch.randint(4, vocab, (5 + p,), generator=g)
        for s in range(samples):
            response = torch.randint(4, vocab, (3 + (s * 5) % 9,), generator=g)
            rows.append(torch.cat([prompt, response]))
            prompt_lens.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros((len(rows), width - 1))
    for i, (row, p) in enumerate(zip(rows, prompt_lens, strict=True)):
        ids[i, : len(row)], attention[i, : len(row)] = row, 1
        loss_mask[i, p - 1 : len(row) - 1] = 1
    n = len(rows)
    batch = TrainBatch(ids, attention, loss_mask, torch.zeros(n, width - 1), torch.ones(n))
    batch.prompt_lens = torch.tensor(prompt_lens) if shared else None
    return batch


def _model(tiny_hf, precision: str = FP32, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    with torch.no_grad():  # a trained head: logits far from uniform
        model.get_output_embeddings().weight.normal_(0, 0.5)
    return set_precision(model, precision)


def _pass(model, batch, chunk: int, entropy_grad: bool = True):
    model.zero_grad(set_to_none=True)
    logp, entropy = sequence_logprobs(
        model, batch, 0.8, with_entropy=True, entropy_grad=entropy_grad, chunk_tokens=chunk
    )
    mask = batch.loss_mask[:, batch.target_offset :]
    loss = -(logp * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach() * mask, entropy.detach() * mask, grads


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "plain"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_log_probs_entropies_and_gradients_equal_the_unchunked_ones(tiny_hf, shared, chunk):
    model = _model(tiny_hf)
    batch = _batch(model.config.vocab_size, shared=shared)
    whole = _pass(model, batch, -1)
    chunked = _pass(model, batch, chunk)
    torch.testing.assert_close(chunked[0], whole[0], **TOLERANCE)
    torch.testing.assert_close(chunked[1], whole[1], **TOLERANCE)
    assert chunked[2].keys() == whole[2].keys()
    head = model.get_output_embeddings().weight  # tied: its gradient is the embedding's too
    assert any(p is head for n, p in model.named_parameters() if n in whole[2])
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, **TOLERANCE, msg=name)


def test_one_chunk_is_the_unchunked_arithmetic_bit_for_bit(tiny_hf):
    """A chunk at least the batch's size runs the head once on the whole batch: the built-in
    model (under 3,000 words) never chunks by default, and its runs keep their exact tensors."""
    model = _model(tiny_hf)
    batch = _batch(model.config.vocab_size, shared=False)
    with torch.no_grad():
        kept = batch.input_ids.shape[1] - batch.target_offset
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=kept
        ).logits[:, :-1]
        reference = token_logprobs(logits, batch.targets, 0.8, with_entropy=True)
    whole = _pass(model, batch, -1)
    big = _pass(model, batch, 10_000)
    mask = batch.loss_mask[:, batch.target_offset :]
    assert torch.equal(whole[0], reference[0] * mask)
    assert torch.equal(whole[1], reference[1] * mask)
    assert torch.equal(big[0], whole[0])
    assert all(torch.equal(big[2][n], g) for n, g in whole[2].items())


def test_bf16_chunks_match_bf16_whole(tiny_hf):
    model = _model(tiny_hf, BF16)
    batch = _batch(model.config.vocab_size)
    whole, chunked = _pass(model, batch, -1), _pass(model, batch, 5)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-3, atol=1e-3)
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-3, atol=1e-3, msg=name)


def test_lora_model_chunks_its_frozen_head(tiny_hf):
    from mileage.models.lora import LoraConfig, apply_lora

    def lora_model():
        cfg = LoraConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear")
        return apply_lora(_model(tiny_hf), cfg, seed=1)[0]

    assert isinstance(hidden_head(lora_model()), HiddenHead)
    batch = _batch(40)
    whole, chunked = _pass(lora_model(), batch, -1), _pass(lora_model(), batch, 3)
    assert whole[2] and "lm_head.weight" not in " ".join(whole[2])  # only adapters train
    torch.testing.assert_close(chunked[0], whole[0], **TOLERANCE)
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, **TOLERANCE, msg=name)


def test_the_whole_batchs_logits_never_exist(tiny_hf, monkeypatch):
    """Every matmul of the head is one chunk's: its output has at most `chunk` rows."""
    model = _model(tiny_hf)
    batch = _batch(model.config.vocab_size, shared=False)
    rows = []
    real = logprobs.F.linear

    def linear(x, w, b=None):
        out = real(x, w, b)
        if w.shape[0] == model.config.vocab_size:
            rows.append(out.reshape(-1, out.shape[-1]).shape[0])
        return out

    monkeypatch.setattr(logprobs.F, "linear", linear)
    _pass(model, batch, 6)
    tokens = batch.input_ids.shape[0] * (batch.input_ids.shape[1] - batch.target_offset)
    assert max(rows) == 6 and sum(rows) == 2 * tokens  # forward, and the backward's recompute


def test_a_head_that_is_not_a_plain_linear_gives_its_logits(tiny_hf):
    model = _model(tiny_hf)

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    head = model.get_output_embeddings()
    head.__class__ = Scaled
    assert hidden_head(model) is None
    batch = _batch(model.config.vocab_size, shared=False)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, 1.0, chunk_tokens=4)
        kept = batch.input_ids.shape[1] - batch.target_offset
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=kept
        ).logits[:, :-1]
    assert torch.equal(logp, token_logprobs(logits, batch.targets)[0])


def test_the_head_switch_keeps_weights_and_is_scoped_to_its_thread(tiny_hf):
    import threading

    from mileage.models.lm_head import on_hidden

    model = _model(tiny_hf)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    head = hidden_head(model)
    assert isinstance(head, HiddenHead)
    x = torch.randn(2, head.in_features)
    seen = []
    with on_hidden(lambda hidden, h: hidden.new_zeros(1)):
        assert head(x).shape == (1,)
        other = threading.Thread(target=lambda: seen.append(head(x).shape))
        other.start()
        other.join()
    assert seen == [(2, head.out_features)]  # another thread (the async engine) gets logits
    assert head(x).shape == (2, head.out_features)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_default_chunk_and_refusals():
    assert AlgoConfig().chunk_tokens(49152) == LOGITS_CHUNK_BYTES // (4 * 49152) == 341
    assert AlgoConfig().chunk_tokens(40) > 100_000  # the built-in model: one chunk
    assert AlgoConfig(log_probs_chunk_size=-1).chunk_tokens(49152) == -1
    assert AlgoConfig(log_probs_chunk_size=128).chunk_tokens(49152) == 128
    for bad in (0, -2):
        with pytest.raises(UserError, match="--log-probs-chunk-size"):
            AlgoConfig(log_probs_chunk_size=bad).validate(4)


def test_head_logprobs_without_grad_keeps_no_graph(tiny_hf):
    model = _model(tiny_hf)
    head = model.get_output_embeddings()
    hidden = torch.randn(3, 5, head.in_features)
    targets = torch.randint(0, head.out_features, (3, 5))
    with torch.no_grad():
        out = head_logprobs(head, hidden, targets, 1.0, True, False, 4)
    assert out.shape == (3, 5, 2) and out.grad_fn is None
    logits = torch.nn.functional.linear(hidden, head.weight)
    expected = token_logprobs(logits, targets, with_entropy=True)
    torch.testing.assert_close(out[..., 0], expected[0], **TOLERANCE)
    torch.testing.assert_close(out[..., 1], expected[1], **TOLERANCE)


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy-trained", "entropy-logged"])
def test_the_chunked_heads_gradients_are_the_derivatives(entropy_grad):
    """The chunked head's hand-written backward (every chunk's weight gradient added into one
    buffer) against finite differences, in fp64, with a bias and a temperature."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)

    def head(h, w, b):
        out = logprobs.ChunkedHead.apply(h, targets, w, b, 0.7, True, entropy_grad, 3)
        return out if entropy_grad else out[:, :1]  # a logged entropy carries no gradient

    assert torch.autograd.gradcheck(head, (hidden, weight, bias))
