"""Logits in fp32 for sampling from a bf16 model (`--no-fp32-lm-head` turns it off).

Under bf16 autocast the LM head's output, the logits, is rounded to bf16: steps of 1/16 to 1/8 at
the magnitudes a trained policy's top logits reach, so every sampling probability is off by up
to 3-6 %. On the built-in demo that rounding in the *engine* alone gave held-out accuracy a bad
tail across seeds (0.72-0.73 against fp32's 0.83 on two of five), where sampling from fp32
logits with everything else in bf16 stayed within noise of fp32 on every seed tried
(docs/recipe.md). MiniMax-M1 traced its train/inference probability gap to the same head, and
SGLang offers `--enable-fp32-lm-head` for it.

So while `fp32_logits()` is active (the engine's generation), an LM head switched by
`use_fp32_logits` multiplies the hidden state and its fp32 master weight in fp32. Training
forwards keep the bf16 head: the old log-probs are the trainer's own, so the PPO ratio does not
see the difference, and `logprob_abs_diff` logs it. The head changes class in place, so its
parameters, their tying to the embedding and the state dict stay as they are.

On a CPU that product runs on the weight reordered once per `fp32_logits()` context for oneDNN
(`mileage.models.packed`): at decode shapes the stock fp32 matmul is slow, SmolLM2's head took
17-27 ms for 16 rows against 4.5 ms reordered, and 4-5 ms in bf16 (AMD EPYC with AVX-512,
2 threads), so the fp32 head costs about what a bf16 one does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from mileage.models.packed import PackedLinear, linear, packed_weight, packed_weights

_state = threading.local()  # generation may run in any thread (async driver, `mileage serve`)

# what a head given to `on_hidden` returns instead of its logits: f(hidden states, the head)
HiddenFn = Callable[[torch.Tensor, torch.nn.Linear], torch.Tensor]


class HiddenHead(PackedLinear):
    """An `nn.Linear` LM head that, inside `on_hidden(fn)` in this thread, returns
    `fn(hidden, head)` instead of its logits: the caller computes what it needs from the hidden
    states (log-probs a chunk of tokens at a time, `mileage.training.logprobs`) while the head
    still runs inside the model's forward, where a sharded model's parameters are gathered."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fn = getattr(_state, "on_hidden", None)
        if fn is not None:
            return fn(hidden, self)
        return super().forward(hidden)


def hidden_head(model: torch.nn.Module) -> HiddenHead | None:
    """`model`'s LM head, made a `HiddenHead` in place if it is a plain linear one (only the
    class changes: parameters, tying and the state dict stay); None where the head is anything
    else (a LoRA-wrapped head, a model without one) or the model post-processes its logits."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if isinstance(head, HiddenHead):
        return head
    if type(head) not in (torch.nn.Linear, PackedLinear):
        return None
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):  # Gemma: logits change after the head
        return None
    head.__class__ = HiddenHead
    return head


@contextlib.contextmanager
def on_hidden(fn: HiddenFn) -> Iterator[None]:
    """Inside the context, `HiddenHead`s in this thread return `fn(hidden, head)`."""
    before = getattr(_state, "on_hidden", None)
    _state.on_hidden = fn
    try:
        yield
    finally:
        _state.on_hidden = before


class Fp32LogitsLinear(HiddenHead):
    """An `nn.Linear` LM head that computes in fp32 inside `fp32_logits()`."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(_state, "on_hidden", None) is not None or not getattr(_state, "active", False):
            return super().forward(hidden)
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(hidden.device.type, enabled=False):
            packed = packed_weight(self)
            if packed is None:
                return F.linear(hidden.float(), self.weight.float(), bias)
            return linear(hidden.float(), packed, bias)


def use_fp32_logits(model: torch.nn.Module, enabled: bool) -> bool:
    """Switch `model`'s LM head to (or back from) `Fp32LogitsLinear`; False where the head is
    not a plain `nn.Linear` (a LoRA-wrapped head, a model without one): it is left as it is."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if type(head) not in (torch.nn.Linear, PackedLinear, HiddenHead, Fp32LogitsLinear):
        return False
    head.__class__ = Fp32LogitsLinear if enabled else torch.nn.Linear
    return enabled


def has_fp32_logits(model: torch.nn.Module) -> bool:
    """Whether `model` (or a model inside it) has its LM head switched to fp32 logits."""
    return any(isinstance(m, Fp32LogitsLinear) for m in model.modules())


@contextlib.contextmanager
def fp32_logits() -> Iterator[None]:
    """Switched LM heads compute in fp32 in this thread until the context ends. Their weights
    must not change inside it (their oneDNN layout is made once: `packed_weights`)."""
    before = getattr(_state, "active", False)
    _state.active = True
    try:
        with packed_weights():
            yield
    finally:
        _state.active = before
