"""Per-token log-probs and entropies from vocabulary-sized logits, a block of rows at a time.

Autograd over `log_softmax` keeps several fp32 copies of the [batch, tokens, vocabulary] logits
alive (the upcast, the normaliser's exponentials, the gather's scattered gradient, the logged
entropy's intermediates): 400 MB each for 64 x 32 tokens of SmolLM2's 49152-word vocabulary.
On a CPU each fresh buffer of that size is paged in from the kernel, and these elementwise
passes took 15 % of a bf16 training pass (docs/benchmarks.md). `TokenLogprobs` instead works on
`BLOCK_ELEMENTS`-sized blocks of rows that stay in cache, and its backward recomputes the
softmax of a block from the saved logits and the per-row normaliser.

The forward values are the same bits as the unblocked arithmetic (every reduction runs along
one row, and a row never straddles blocks). The gradient of the log-prob is too; the entropy
bonus's gradient, written out by hand, matches autograd's to rounding.

`head_logprobs` goes one step further, as miles' `--log-probs-chunk-size` and Liger-Kernel's
fused linear cross-entropy do: it takes the LM head's *input*, and computes the head, the
log-prob and the entropy a chunk of tokens at a time, so the whole batch's logits never exist.
Under autograd the backward recomputes each chunk's logits (`ChunkedHead`). For SmolLM2
(49,152 words) the logits of 64 samples x 190 tokens were 2.4 GB per fp32 copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mileage.models.lm_head import hidden_head, on_hidden

# rows per block = BLOCK_ELEMENTS // vocabulary: 4 MiB of fp32 per working buffer
BLOCK_ELEMENTS = 1 << 20


class TokenLogprobs(torch.autograd.Function):
    """(log p(target), entropy) per row of `logits`; see `token_logprobs`."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, entropy_grad):
        logp, entropy, norm = logprob_values(logits, targets, temperature, with_entropy)
        keep_entropy = entropy if with_entropy and entropy_grad else None
        ctx.save_for_backward(logits, targets, norm, keep_entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        logp = logp.view(targets.shape)
        if not with_entropy:
            return logp, None
        entropy = entropy.view(targets.shape)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, norm, entropy = ctx.saved_tensors
        grad = logits_grad(logits, targets, norm, entropy, grad_logp, grad_entropy, ctx.temperature)
        return grad, None, None, None, None


def logprob_values(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(log p(target), entropy or None, log-normaliser) per row of `logits`, flattened."""
    vocab = logits.shape[-1]
    flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1)
    rows = flat.shape[0]
    norm = torch.empty(rows, dtype=_compute_dtype(logits), device=logits.device)
    logp = torch.empty_like(norm)
    entropy = torch.empty_like(norm) if with_entropy else None
    for block in _blocks(rows, vocab):
        x = _scaled_fp32(flat[block], temperature)
        norm[block] = torch.logsumexp(x, dim=-1)
        logp[block] = x.gather(-1, flat_targets[block]).squeeze(-1) - norm[block]
        if with_entropy:
            log_probs = x.sub_(norm[block].unsqueeze(-1))
            entropy[block] = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy, norm


def logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    norm: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    in_place: bool = False,
) -> torch.Tensor:
    """The gradient of (log p(target), entropy) with respect to `logits`, in their dtype, from
    each row's normaliser `norm` (and `entropy`, None when it carries no gradient); written
    over `logits` with `in_place` (each block is read before it is written)."""
    vocab = logits.shape[-1]
    flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1)
    if grad_logp is not None:
        grad_logp = grad_logp.reshape(-1, 1)
    if entropy is None:
        grad_entropy = None
    if grad_entropy is not None:
        grad_entropy = grad_entropy.reshape(-1, 1)
    grad = flat if in_place else torch.empty_like(flat)
    for block in _blocks(flat.shape[0], vocab):
        log_probs = _scaled_fp32(flat[block], temperature).sub_(norm[block].unsqueeze(-1))
        probs = log_probs.exp()
        if grad_entropy is not None:
            # H = -sum_j p_j log p_j, so dH/dx_k = -p_k (log p_k + H)
            g = log_probs.add_(entropy[block].unsqueeze(-1)).mul_(probs)
            g.mul_(-grad_entropy[block])
        else:
            g = torch.zeros_like(probs)
        if grad_logp is not None:
            # log p_t = x_t - logsumexp(x): d/dx_k = [k == t] - p_k
            g.sub_(probs * grad_logp[block])
            g.scatter_add_(-1, flat_targets[block], grad_logp[block])
        if temperature not in (0.0, 1.0):
            g.div_(temperature)
        grad[block] = g
    return grad.view_as(logits)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) per position (and the entropy of each position's distribution), in fp32
    (or the logits' dtype if wider).

    `logits[:, i]` scores `targets[:, i]`; logits are divided by `temperature` (0 and 1 leave
    them as they are). With `entropy_grad=False` the entropy is only logged: it carries no
    gradient and nothing is kept for it.
    """
    return TokenLogprobs.apply(logits, targets, temperature, with_entropy, entropy_grad)


def model_logprobs(
    model: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_tokens: int,
    **forward_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob, entropy) of `targets` from `model(**forward_kwargs)`, whose output positions
    `targets` lines up with. With a plain linear LM head the head runs on `head_logprobs`
    inside the model's forward (so a sharded model's gathered weights serve it, and the output
    that FSDP2 hooks for the backward is the log-probs); any other head gives its logits."""
    head = hidden_head(model)
    if head is None:
        logits = model(**forward_kwargs).logits
        return token_logprobs(logits, targets, temperature, with_entropy, entropy_grad)

    def from_hidden(hidden: torch.Tensor, head: torch.nn.Linear) -> torch.Tensor:
        return head_logprobs(
            head, hidden, targets, temperature, with_entropy, entropy_grad, chunk_tokens
        )

    with on_hidden(from_hidden):
        stacked = model(**forward_kwargs).logits
    return stacked[..., 0], (stacked[..., 1] if with_entropy else None)


def head_logprobs(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = -1,
) -> torch.Tensor:
    """`token_logprobs(head(hidden), targets, ...)`, stacked as `[..., 1]` (log-prob) or
    `[..., 2]` (log-prob, entropy), computed `chunk_tokens` positions at a time (-1: all at
    once). One chunk is the unchunked arithmetic exactly; with several, each chunk's matmul has
    fewer rows and may round differently (~1e-6 relative, tests/test_chunked_logprobs.py)."""
    width = hidden.shape[-1]
    flat, flat_targets = hidden.reshape(-1, width), targets.reshape(-1)
    rows = flat.shape[0]
    args = (head.weight, head.bias, temperature, with_entropy, entropy_grad)
    if chunk_tokens < 0 or rows <= chunk_tokens:
        out = _chunk_logprobs(flat, flat_targets, *args)
    else:
        out = ChunkedHead.apply(flat, flat_targets, *args, chunk_tokens)
    # a copy, not a view: this is the output of a sharded model's forward, and FSDP2 hooks its
    # backward on that tensor; on a view an in-place op would drop the hook (torch warns at every
    # step). [..., 1 or 2] floats per token: small beside the logits never kept
    return out.reshape(*targets.shape, out.shape[-1]).clone()


class ChunkedHead(torch.autograd.Function):
    """`_chunk_logprobs` a chunk of rows at a time: a chunk's logits exist only while it is
    computed, in the forward and again in the backward, where every chunk's gradient of the
    weight, a product in the matmul's dtype (autocast's), is added into one buffer of the
    weight's own. The backward recomputes each chunk's logits from the operands autocast gave
    the forward's matmul (cast once for all chunks), so they are the forward's bits.

    Each chunk was a checkpointed autograd node of its own. That gave each its own weight-sized
    gradient, and autograd summed the first two out of place: three at once, 324 MiB of SmolLM2's
    fp32 head at the training pass's peak. In bf16 it also made the gradient depend on other
    threads: autocast's cast cache is one per process and empties whenever any thread leaves its
    last autocast context (train-async's generation thread does at every batch), so whether the
    chunks shared one bf16 cast of the weight (their gradients summed in bf16) or cast it again
    (summed in fp32) changed from step to step. One node has one way."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, temperature, with_entropy, entropy_grad, chunk):
        spans = [
            slice(a, min(a + chunk, hidden.shape[0])) for a in range(0, hidden.shape[0], chunk)
        ]
        pieces, norms, entropies = [], [], []
        for span in spans:
            logits = F.linear(hidden[span], weight, bias)
            logp, entropy, norm = logprob_values(logits, targets[span], temperature, with_entropy)
            pieces.append(
                logp.unsqueeze(-1) if entropy is None else torch.stack([logp, entropy], -1)
            )
            norms.append(norm)
            entropies.append(entropy)
        keep_entropy = torch.cat(entropies) if with_entropy and entropy_grad else None
        ctx.save_for_backward(hidden, targets, weight, bias, torch.cat(norms), keep_entropy)
        ctx.spans, ctx.temperature = spans, temperature
        device = hidden.device.type
        ctx.cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, targets, weight, bias, norm, entropy = ctx.saved_tensors
        need_hidden, _, need_weight, need_bias = ctx.needs_input_grad[:4]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = grad_bias = None
        # the matmul's operands as autocast gave them to the forward's, cast once here
        used_weight, used_bias = (_autocast_operand(t, ctx.cast) for t in (weight, bias))
        for span in reversed(ctx.spans):  # the order autograd summed checkpointed chunks in
            used_hidden = _autocast_operand(hidden[span], ctx.cast)
            logits = F.linear(used_hidden, used_weight, used_bias)  # the forward's bits
            grad = logits_grad(
                logits,
                targets[span],
                norm[span],
                None if entropy is None else entropy[span],
                grad_out[span, 0],
                grad_out[span, 1] if entropy is not None else None,
                ctx.temperature,
                in_place=True,  # the recomputed logits are not needed after
            )
            if need_hidden:
                grad_hidden[span] = grad.mm(used_weight)
            if need_weight:
                grad_weight = _add_product(grad_weight, grad.t(), used_hidden, weight)
            if need_bias:
                part = grad.sum(0).to(bias.dtype)
                grad_bias = part if grad_bias is None else grad_bias.add_(part)
        return grad_hidden, None, grad_weight, grad_bias, None, None, None, None


def _autocast_operand(
    tensor: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor | None:
    """`tensor` as autocast (to `dtype`; None: off) hands it to a matmul: floating tensors but
    fp64 ones are cast."""
    if tensor is None or dtype is None or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _add_product(
    total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """`total + a @ b` in `like`'s dtype, into `total` (a fresh one when None); one fused matmul
    when the product is in that dtype already, so no product-sized copy is made."""
    if total is None:
        return a.mm(b).to(like.dtype)
    if a.dtype == total.dtype:
        return total.addmm_(a, b)
    return total.add_(a.mm(b))


def _chunk_logprobs(hidden, targets, weight, bias, temperature, with_entropy, entropy_grad):
    logits = F.linear(hidden, weight, bias)
    logp, entropy = TokenLogprobs.apply(logits, targets, temperature, with_entropy, entropy_grad)
    return logp.unsqueeze(-1) if entropy is None else torch.stack([logp, entropy], -1)


def _blocks(rows: int, vocab: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # fp32 at least: bf16 logits are normalised in fp32 (fp64 ones stay fp64, for gradcheck)
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # a fresh copy even when the logits are fp32 already: callers modify it in place
    x = logits.to(_compute_dtype(logits), copy=True)
    if temperature not in (0.0, 1.0):
        x.div_(temperature)
    return x
