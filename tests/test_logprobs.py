"""The blocked log-prob/entropy function against autograd over the unblocked arithmetic."""

import pytest
import torch

from mileage.training import logprobs
from mileage.training.logprobs import token_logprobs


def _reference(logits, targets, temperature, entropy_grad):
    # the arithmetic token_logprobs replaced: autograd over the whole [B, T, V] tensor at once
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    norm = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    with torch.set_grad_enabled(entropy_grad):
        log_probs = x - norm.unsqueeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


@pytest.fixture
def small_blocks(monkeypatch):
    # 3 rows of a 7-word vocabulary per block: 20 rows make 7 blocks, the last one short
    monkeypatch.setattr(logprobs, "BLOCK_ELEMENTS", 21)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_blocks_give_the_unblocked_values_and_gradients(
    small_blocks, dtype, temperature, entropy_grad
):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 5, 7, generator=gen) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 7, (4, 5), generator=gen)
    w_logp, w_ent = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    before = logits.detach().clone()

    def loss_and_grad(fn):
        logp, entropy = fn(logits, targets, temperature, entropy_grad)
        loss = (logp * w_logp).sum() + ((entropy * w_ent).sum() if entropy_grad else 0.0)
        (grad,) = torch.autograd.grad(loss, logits)
        return logp.detach(), entropy.detach(), grad.float()

    def blocked(*args):
        return token_logprobs(*args[:3], with_entropy=True, entropy_grad=args[3])

    want, got = loss_and_grad(_reference), loss_and_grad(blocked)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if entropy_grad:  # written out by hand, so equal to rounding
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got[2], want[2])
    assert torch.equal(logits.detach(), before)  # the blocks work on copies


def test_gradients_pass_gradcheck_in_float64(small_blocks):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (2, 4), generator=gen)
    for temperature in (1.0, 0.5):
        assert torch.autograd.gradcheck(
            lambda x, t=temperature: token_logprobs(x, targets, t, True, True), (logits,)
        )
        assert torch.autograd.gradcheck(
            lambda x, t=temperature: token_logprobs(x, targets, t)[0], (logits,)
        )


def test_logged_entropy_carries_no_gradient_and_no_grad_mode_works():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3))
    logp, logged = token_logprobs(logits, targets, with_entropy=True, entropy_grad=False)
    assert logp.requires_grad and not logged.requires_grad
    logp.sum().backward()  # the entropy output's missing gradient is not an error
    assert logits.grad is not None
    with torch.no_grad():
        again, none = token_logprobs(logits, targets)
    assert none is None and not again.requires_grad and torch.equal(again, logp.detach())
