"""Token-budget micro-batches (`--use-dynamic-batch-size --max-tokens-per-gpu`, miles' flags).

With a fixed `--micro-batch-size`, every micro-batch is right-padded to its longest sample: with
RL's long-tailed response lengths most of a pass's arithmetic is then spent on padding. Here a
micro-batch is instead a contiguous run of samples holding at most `--max-tokens-per-gpu`
tokens (prompt + response), and its forward is *packed*: the samples' tokens run as one row,
with position ids restarting at 0 for each sample. The attention then never crosses a sample:
transformers reads the restarting positions as packed sequences (a block-diagonal causal mask),
and `mileage_sdpa` (`mileage.models.attention`) runs each sample's causal attention on its own
(flash-attention's varlen kernel on a GPU where the `flash_attn` package is installed), so no
pass computes the cross-sample scores either.

Only the forward's layout changes: its log-probs, entropies and values come back in the padded
"target" space of `mileage.training.batch`, so the loss, its normalisation (per-sample mean or
`--calculate-per-token-loss`) and every consumer are the padded path's. The log-probs equal the
padded ones to rounding (other matmul shapes), which tests/test_packing.py checks.

Micro-batches are cut greedily in order, so they are a pure function of the batch: a resumed run
cuts the same ones. Under torchrun every rank must run as many forwards and backwards as the
others (FSDP2's collectives pair them up): ranks agree on the largest count, and a rank with
fewer splits its largest micro-batches in two until it has as many.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mileage import ranks
from mileage.models.lm_head import hidden_head, on_hidden
from mileage.precision import autocast
from mileage.training.batch import TrainBatch
from mileage.training.logprobs import head_logprobs, token_logprobs

Range = tuple[int, int]


def token_bins(lengths: list[int], budget: int, start: int = 0) -> list[Range]:
    """Contiguous (start, end) runs of `lengths` (offset by `start`) of at most `budget` tokens
    each, cut greedily in order; a sample longer than the budget runs alone."""
    bins: list[Range] = []
    first, used = 0, 0
    for i, length in enumerate(lengths):
        if i > first and used + length > budget:
            bins.append((start + first, start + i))
            first, used = i, 0
        used += length
    if lengths:
        bins.append((start + first, start + len(lengths)))
    return bins


def split_to(bins: list[Range], lengths: dict[int, int], count: int) -> list[Range]:
    """`bins` with the largest (by tokens) of those holding two samples or more split in two,
    at the sample that balances its halves best, until there are `count` of them (or none can be
    split). Splitting only shrinks passes, so every budget still holds."""
    bins = list(bins)
    while len(bins) < count:
        splittable = [b for b in bins if b[1] - b[0] > 1]
        if not splittable:
            break
        a, b = max(splittable, key=lambda r: (sum(lengths[i] for i in range(*r)), -r[0]))
        total = sum(lengths[i] for i in range(a, b))
        best, left = a + 1, 0
        best_gap = None
        for cut in range(a + 1, b):
            left += lengths[cut - 1]
            gap = abs(total - 2 * left)
            if best_gap is None or gap < best_gap:
                best, best_gap = cut, gap
        at = bins.index((a, b))
        bins[at : at + 1] = [(a, best), (best, b)]
    return bins


@dataclass(frozen=True)
class Batching:
    """How a batch's rows become forwards: `micro` samples at a time, padded; or, with
    `max_tokens`, runs of samples of at most that many tokens, each packed into one row."""

    micro: int
    max_tokens: int | None = None

    @property
    def packed(self) -> bool:
        return self.max_tokens is not None

    def parts(self, batch: TrainBatch) -> Iterator[tuple[int, TrainBatch]]:
        """(first row, micro-batch) over the whole batch: the no-grad log-prob and value passes,
        which every rank runs on every row."""
        if not self.packed:
            ranges = [
                (s, min(s + self.micro, len(batch))) for s in range(0, len(batch), self.micro)
            ]
        else:
            ranges = token_bins(_lengths(batch), self.max_tokens)
        for start, end in ranges:
            yield start, self._cut(batch, start, end)

    def rank_parts(self, batch: TrainBatch, start: int, global_batch: int) -> Iterator[TrainBatch]:
        """This rank's micro-batches of the global batch at `start`: the same number on every
        rank (`ranks.micro_batches` with a fixed size; agreed here with a token budget)."""
        if not self.packed:
            ranges = ranks.micro_batches(start, global_batch, self.micro)
        else:
            mine = ranks.share(global_batch)
            first = start + mine.start
            lengths = _lengths(batch)[first : first + len(mine)]
            ranges = token_bins(lengths, self.max_tokens, first)
            count = max(ranks.all_gather_object(len(ranges)))
            ranges = split_to(ranges, dict(enumerate(lengths, first)), count)
        for s, e in ranges:
            yield self._cut(batch, s, e)

    def _cut(self, batch: TrainBatch, start: int, end: int) -> TrainBatch:
        part = batch.slice(start, end)
        return replace(part, packed=True) if self.packed else part


def _lengths(batch: TrainBatch) -> list[int]:
    return batch.attention_mask.sum(dim=1).tolist()


@dataclass(frozen=True)
class Packed:
    """A padded micro-batch's tokens as one row, and where its target columns are in it."""

    input_ids: torch.Tensor  # [1, T]: every row's tokens, back to back
    position_ids: torch.Tensor  # [1, T]: 0, 1, ... restarting for each row
    rows: torch.Tensor  # [K] the row of each scored target column ...
    columns: torch.Tensor  # [K] ... its column in the micro-batch's target space ...
    positions: torch.Tensor  # [K] ... and the packed position whose output scores it
    width: int  # target columns of the micro-batch (from its `target_offset` on)

    def forward_kwargs(self) -> dict:
        """The model's inputs: no attention mask and no cache (transformers then builds the
        packed sequences' block-diagonal mask from the positions), and the sequence boundaries
        as transformers' varlen arguments, read from the positions alone (so they can never
        disagree)."""
        starts = (self.position_ids[0] == 0).nonzero().flatten()
        total = self.position_ids.shape[1]
        cu = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def unpack(self, values: torch.Tensor, rows: int) -> torch.Tensor:
        """`values` [K] (one per scored target column) -> [rows, width], 0 elsewhere."""
        out = values.new_zeros((rows, self.width))
        return out.index_put((self.rows, self.columns), values)


def pack(batch: TrainBatch, response_only: bool) -> Packed:
    """`batch` (right-padded rows) packed into one row. Its scored target columns: from
    `target_offset` on within each row, and with `response_only` from the row's first response
    token on (prompt columns are never in a loss mask)."""
    device = batch.input_ids.device
    lengths = batch.attention_mask.sum(dim=1)
    valid = batch.attention_mask.bool()
    input_ids = batch.input_ids[valid].unsqueeze(0)
    offsets = F.pad(lengths.cumsum(0), (1, 0))[:-1]
    steps = torch.arange(input_ids.shape[1], device=device)
    position_ids = (steps - offsets.repeat_interleave(lengths)).unsqueeze(0)
    # row i scores target columns [lo_i, hi_i): column c is predicted at its position c
    lo = torch.full_like(lengths, batch.target_offset)
    if response_only and batch.prompt_lens is not None:
        lo = torch.maximum(lo, batch.prompt_lens.to(device) - 1)
    hi = (lengths - 1).clamp(min=0)
    counts = (hi - lo).clamp(min=0)
    rows = torch.arange(len(lengths), device=device).repeat_interleave(counts)
    first = F.pad(counts.cumsum(0), (1, 0))[:-1]
    within = torch.arange(int(counts.sum()), device=device) - first.repeat_interleave(counts)
    columns = lo[rows] + within
    return Packed(
        input_ids=input_ids,
        position_ids=position_ids,
        rows=rows,
        columns=columns - batch.target_offset,
        positions=offsets[rows] + columns,
        width=batch.input_ids.shape[1] - 1 - batch.target_offset,
    )


def packed_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` of a micro-batch run as one packed row: the LM head and log-softmax
    run on the response positions only, and the results come back in the batch's target space
    (0 on prompt columns and padding)."""
    packed = pack(batch, response_only=True)
    targets = packed.input_ids[0, packed.positions + 1].unsqueeze(0)
    head = hidden_head(model)
    with autocast(model):
        if head is not None:

            def from_hidden(hidden: torch.Tensor, head: torch.nn.Linear) -> torch.Tensor:
                chosen = hidden[:, packed.positions]
                return head_logprobs(
                    head, chosen, targets, temperature, with_entropy, entropy_grad, chunk_tokens
                )

            with on_hidden(from_hidden):
                stacked = model(**packed.forward_kwargs()).logits[0]
            logp, entropy = stacked[:, 0], (stacked[:, 1] if with_entropy else None)
        else:
            logits = model(**packed.forward_kwargs()).logits[:, packed.positions]
            logp, entropy = token_logprobs(logits, targets, temperature, with_entropy, entropy_grad)
            logp, entropy = logp[0], (None if entropy is None else entropy[0])
    rows = len(batch)
    return packed.unpack(logp, rows), (None if entropy is None else packed.unpack(entropy, rows))


def packed_values(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """The critic's values (`mileage.training.critic.sequence_values`) of a micro-batch run as
    one packed row, in the batch's target space."""
    packed = pack(batch, response_only=False)
    with autocast(model):
        values = model(**packed.forward_kwargs())
    return packed.unpack(values[0, packed.positions], len(batch))
