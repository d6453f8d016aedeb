"""`--gradient-checkpointing`: each decoder layer recomputes its forward in the backward. The
gradients are the uncheckpointed ones bit for bit (dropout included: the recompute replays the
RNG), autograd keeps a fraction of the activations, and the memory plan counts it."""

from __future__ import annotations

import torch
from test_chunked_logprobs import _batch
from transformers import AutoModelForCausalLM

from mileage.errors import UserError
from mileage.models.activation_checkpointing import (
    checkpointed_layers,
    enable_activation_checkpointing,
)
from mileage.training.actor import sequence_logprobs


def _model(tiny_hf, dropout: float = 0.0, layers_checkpointed: bool = False):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, attention_dropout=dropout)
    if layers_checkpointed:
        assert enable_activation_checkpointing(model) == model.config.num_hidden_layers
    return model.train()


def _grads(model, batch, seed: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the dropout masks of the forward
    logp, _ = sequence_logprobs(model, batch, 1.0, chunk_tokens=-1)
    (logp * batch.loss_mask[:, batch.target_offset :]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model, batch) -> int:
    """Bytes autograd keeps for the backward during one training forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_logprobs(model, batch, 1.0, chunk_tokens=-1)
    return total


def test_checkpointed_gradients_equal_the_kept_ones_with_dropout(tiny_hf):
    vocab = AutoModelForCausalLM.from_pretrained(tiny_hf).config.vocab_size
    batch = _batch(vocab, shared=False)
    kept = _grads(_model(tiny_hf, dropout=0.3), batch)
    checkpointed = _grads(_model(tiny_hf, dropout=0.3, layers_checkpointed=True), batch)
    assert kept.keys() == checkpointed.keys() and kept
    for name, grad in kept.items():
        assert torch.equal(grad, checkpointed[name]), name
    # and the dropout did act: another seed's masks give other gradients
    other = _grads(_model(tiny_hf, dropout=0.3, layers_checkpointed=True), batch, seed=4)
    assert any(not torch.equal(g, other[n]) for n, g in kept.items())


def test_lora_policy_and_critic_body_are_checkpointed_and_train_the_same(tiny_hf):
    from mileage.models.lora import LoraConfig, apply_lora
    from mileage.training.critic import ValueModel

    def lora(checkpointed: bool):
        cfg = LoraConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.2)
        model = apply_lora(_model(tiny_hf), cfg, seed=1)[0].train()
        if checkpointed:
            assert enable_activation_checkpointing(model) == 2
        return model

    vocab = AutoModelForCausalLM.from_pretrained(tiny_hf).config.vocab_size
    batch = _batch(vocab, shared=False)  # checkpointed layers run every row whole
    kept, checkpointed = _grads(lora(False), batch), _grads(lora(True), batch)
    assert kept and all("lora_" in name for name in kept)  # the frozen base has no gradient
    assert all(torch.equal(g, checkpointed[n]) for n, g in kept.items())

    critic = ValueModel(_model(tiny_hf), seed=0)
    assert enable_activation_checkpointing(None, critic) == 2 == checkpointed_layers(critic)


def test_autograd_keeps_a_fraction_of_the_activations(tiny_hf):
    vocab = AutoModelForCausalLM.from_pretrained(tiny_hf).config.vocab_size
    batch = _batch(vocab, prompts=4, samples=4, shared=False)
    kept = _saved_bytes(_model(tiny_hf), batch)
    checkpointed = _saved_bytes(_model(tiny_hf, layers_checkpointed=True), batch)
    assert checkpointed < 0.6 * kept, (checkpointed, kept)
    # generation and no-grad passes run as before: nothing is recomputed or kept
    model = _model(tiny_hf, layers_checkpointed=True).eval()
    with torch.no_grad():
        assert _saved_bytes(model, batch) == 0


def test_a_model_without_checkpointable_layers_is_refused():
    try:
        enable_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    except UserError as exc:
        assert "--gradient-checkpointing" in str(exc) and "Sequential" in str(exc)
    else:
        raise AssertionError("no refusal")


def test_checkpointed_training_forward_runs_every_row_whole(tiny_hf):
    """Hugging Face's checkpointed layers take no KV cache in training mode, so the shared
    prompt forward steps aside there (and only there)."""
    from mileage.training.shared_prompt import shared_prompt_logprobs

    model = _model(tiny_hf, layers_checkpointed=True)
    batch = _batch(model.config.vocab_size)
    assert shared_prompt_logprobs(model.train(), batch, 1.0) is None
    with torch.no_grad():
        assert shared_prompt_logprobs(model.eval(), batch, 1.0) is not None
