"""The training forward with each distinct prompt computed once per micro-batch.

A GRPO micro-batch holds n samples of each prompt, and a plain forward (and its backward) runs
every prompt n times. Here each distinct prompt, less its last token, runs once with a key/value
cache; every sample gets a copy of its prompt's cache row (`mileage.models.kv_cache.expand_rows`)
and its own tokens, from the prompt's last one on, run against that copy. The prompt's last
token goes with the sample because its logits score the first response token. Autograd sums
the samples' gradients into the prompt rows they share, so the log-probs, the loss and the
gradients are the plain forward's to rounding (other matmul shapes sum in another order).

This is the shared prefix of Prefix Grouper (2025), done with the model's own cache rather than
a custom attention. It applies wherever a micro-batch repeats a prompt and the model takes a
cache; otherwise (`shared_prompt_logprobs` returns None) the caller runs the plain forward. Sharded (FSDP2)
models run the plain forward too: FSDP2 frees a module's gathered weights after its first
backward, and the prompt pass's backward through the same module then read freed memory
(a segmentation fault with torch 2.13 on gloo).

In bf16 both passes cast each weight afresh (`autocast(..., cache_casts=False)`). With autocast's
cast cache, one cast would serve both passes and sum their gradients in bf16 before the fp32
weight; without it, each pass's gradient reaches the fp32 weight on its own. Which of the two
happened depended on autocast in other threads (a model's autocast forwards in a thread beside
training gave 17 distinct gradients in 30 identical steps; with none, or with only tiny autocast
matmuls beside it, 1), so `train-async`, which generates beside training, did not resume bit
for bit. The cache is one per process and empties whenever any thread leaves its last autocast
context; the chunked LM head meets the same in `mileage.training.logprobs.ChunkedHead`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from mileage.models.activation_checkpointing import checkpointed_layers
from mileage.models.kv_cache import expand_rows, shareable_cache
from mileage.precision import autocast
from mileage.training.batch import TrainBatch
from mileage.training.logprobs import model_logprobs


def forward_parameters(model) -> Mapping[str, inspect.Parameter]:
    """The keyword arguments `model`'s forward takes: for a PEFT model, its base model's (PEFT
    passes unknown keywords through to it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inspect.signature(inner.forward).parameters


def _sharded(model) -> bool:
    parameters = model.parameters() if hasattr(model, "parameters") else ()
    return any(type(p.data) is not torch.Tensor for p in parameters)  # DTensor: FSDP2


def shared_prompt_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`sequence_logprobs(model, batch, ...)` with each distinct prompt run once, or None when
    no prompt repeats in `batch`, its prompt lengths are unknown, a prompt is a single token, or
    the model cannot run that way (no cache keyword, layers whose cache cannot be copied,
    sharded parameters, or layers checkpointed in training mode: Hugging Face's checkpointed
    layers take no cache there)."""
    if (
        batch.prompt_lens is None
        or _sharded(model)
        or (model.training and checkpointed_layers(model))
        or not {"cache", "position_ids", "logits_to_keep"} <= set(forward_parameters(model))
    ):
        return None
    prompt_lens = batch.prompt_lens.tolist()
    if min(prompt_lens) < 2:  # no prefix left once the last prompt token moves to the sample
        return None
    first_row: dict[tuple[int, ...], int] = {}
    row_of = [
        first_row.setdefault(tuple(ids[: p - 1]), len(first_row))
        for ids, p in zip(batch.input_ids.tolist(), prompt_lens, strict=True)
    ]
    if len(first_row) == len(row_of):
        return None
    config = getattr(model, "config", None)
    cache = None if config is None else shareable_cache(config)
    if cache is None:
        return None

    device = batch.input_ids.device
    prefixes = list(first_row)
    width = max(len(prefix) for prefix in prefixes)
    prefix_ids = torch.zeros((len(prefixes), width), dtype=torch.long)
    prefix_mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for row, prefix in enumerate(prefixes):
        prefix_ids[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
        prefix_mask[row, : len(prefix)] = 1
    prefix_ids, prefix_mask = prefix_ids.to(device), prefix_mask.to(device)

    # each row's own part: its prompt's last token and its response but the last token as
    # inputs, its response as targets; `starts` are those inputs' positions in the sequence
    starts = batch.prompt_lens.to(device) - 1
    spans = batch.attention_mask.sum(dim=1) - starts - 1  # response tokens per row
    own_width = max(1, int(spans.max()))
    steps = torch.arange(own_width, device=device)
    columns = (starts[:, None] + steps).clamp(max=batch.input_ids.shape[1] - 2)
    inside = steps < spans[:, None]
    own_ids = batch.input_ids.gather(1, columns) * inside
    targets = batch.input_ids.gather(1, columns + 1) * inside

    rows = torch.tensor(row_of, device=device)
    with autocast(model, cache_casts=False):
        # the prompt pass needs no logits; transformers keeps all of them for 0, so keep one
        model(
            input_ids=prefix_ids,
            attention_mask=prefix_mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        expand_rows(cache, rows)
        logp, entropy = model_logprobs(
            model,
            targets,
            temperature,
            with_entropy,
            entropy_grad,
            chunk_tokens,
            input_ids=own_ids,
            attention_mask=torch.cat([prefix_mask[rows], inside.long()], dim=1),
            position_ids=starts[:, None] + steps,
            cache=cache,
            use_cache=True,
        )

    # back to the batch's target columns: column c scores token c + 1, which is row i's own
    # target c - starts[i]; prompt columns get 0 (they are never in a loss mask)
    out_width = batch.input_ids.shape[1] - 1 - batch.target_offset
    own = batch.target_offset + torch.arange(out_width, device=device) - starts[:, None]
    scored = (own >= 0) & (own < spans[:, None])
    own = own.clamp(0, own_width - 1)

    def place(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        return torch.where(scored, values.gather(1, own), values.new_zeros(()))

    return place(logp), place(entropy)
