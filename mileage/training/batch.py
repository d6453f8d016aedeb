"""Packs scored samples into the padded tensors the trainer consumes.

Sequences are prompt + response, right-padded. Everything per-token lives in "target" space:
position i of `targets`, `loss_mask`, `old_logprobs`, ... refers to token i+1 of the sequence,
the token predicted by the logits at position i. A slice drops the leading target columns in
which no row has a response token (`target_offset` of them), so the trainer computes logits
only from the first response position on: with a long shared prompt (a chat template, a system
prompt) most of the LM head and log-softmax work would otherwise be spent on prompt positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    loss_mask: torch.Tensor  # [N, L-1] float, 1 on the policy's response tokens (0: tool tokens)
    old_logprobs: torch.Tensor  # [N, L-1] generating policy
    rewards: torch.Tensor  # [N]
    ref_logprobs: torch.Tensor | None = None
    # --use-opd with a served teacher: its log-prob of each response token (the rollout's)
    teacher_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    tis_weights: torch.Tensor | None = None  # [N, L-1] policy-gradient weights (--use-tis)
    returns: torch.Tensor | None = None  # value targets (PPO critic)
    values: torch.Tensor | None = None  # the critic's values before this rollout's update
    # per-token tensors start at this target column (input_ids and attention_mask do not)
    target_offset: int = 0
    # the old policy is the trainer's weights now and the rollout takes one optimizer step:
    # its forward computes the old log-probs (`old_logprobs` holds the engine's until then)
    old_from_pass: bool = False
    # [N] prompt tokens per row: rows with the same prompt share its forward
    # (`mileage.training.shared_prompt`); None when unknown
    prompt_lens: torch.Tensor | None = None
    # run as one packed row (`mileage.training.packing`, --use-dynamic-batch-size)
    packed: bool = False

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1 + self.target_offset :]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> TrainBatch:
        """This batch with every tensor on `device` (itself when they are there already)."""
        moved = {
            f.name: value.to(device) if isinstance(value, torch.Tensor) else value
            for f in fields(self)
            for value in [getattr(self, f.name)]
        }
        return TrainBatch(**moved)

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed to the longest sequence among them and to the columns
        from the first response token among them on."""
        assert self.target_offset == 0, "slice a packed batch, not a slice"
        width = int(self.attention_mask[start:stop].sum(dim=1).max())
        has_loss = self.loss_mask[start:stop].any(dim=0).nonzero()
        lead = int(has_loss[0]) if len(has_loss) else 0

        def cut(t: torch.Tensor | None, first: int, last: int) -> torch.Tensor | None:
            return None if t is None else t[start:stop, first:last]

        return TrainBatch(
            input_ids=cut(self.input_ids, 0, width),
            attention_mask=cut(self.attention_mask, 0, width),
            loss_mask=cut(self.loss_mask, lead, width - 1),
            old_logprobs=cut(self.old_logprobs, lead, width - 1),
            rewards=self.rewards[start:stop],
            ref_logprobs=cut(self.ref_logprobs, lead, width - 1),
            teacher_logprobs=cut(self.teacher_logprobs, lead, width - 1),
            advantages=cut(self.advantages, lead, width - 1),
            tis_weights=cut(self.tis_weights, lead, width - 1),
            returns=cut(self.returns, lead, width - 1),
            values=cut(self.values, lead, width - 1),
            target_offset=lead,
            old_from_pass=self.old_from_pass,
            prompt_lens=None if self.prompt_lens is None else self.prompt_lens[start:stop],
        )


def pack_samples(samples, pad_id: int) -> TrainBatch:
    """Samples (prompt_ids, response_ids, logprobs, reward, and `mask()`: the per-response-token
    loss mask) -> a right-padded TrainBatch."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    old_logprobs = torch.zeros((n, width - 1))
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[row, : p + r] = 1
        # 1 on the policy's own tokens, 0 on tool/environment tokens (never trained)
        loss_mask[row, p - 1 : p + r - 1] = torch.tensor(s.mask(), dtype=torch.float32)
        old_logprobs[row, p - 1 : p + r - 1] = torch.tensor(s.logprobs)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    return TrainBatch(
        input_ids, attention_mask, loss_mask, old_logprobs, rewards, prompt_lens=prompt_lens
    )


def response_values(batch: TrainBatch, samples, values: list[list[float]]) -> torch.Tensor:
    """Per-response-token `values` of `samples` (as packed into `batch`) in target space, where
    `pack_samples` puts their log-probs; 0 elsewhere."""
    out = torch.zeros_like(batch.old_logprobs)
    for row, (s, v) in enumerate(zip(samples, values, strict=True)):
        p = len(s.prompt_ids)
        out[row, p - 1 : p - 1 + len(v)] = torch.tensor(v, dtype=out.dtype)
    return out


def mask_truncated(batch: TrainBatch, samples) -> int:
    """Zero the loss mask of every sample that hit the length limit without finishing (TRL's
    mask_truncated_completions); returns how many were masked."""
    truncated = [row for row, s in enumerate(samples) if not s.finished]
    if truncated:
        batch.loss_mask[truncated] = 0.0
    return len(truncated)


def mask_offpolicy(batch: TrainBatch, samples, version: int) -> int:
    """Zero the loss mask of every response token generated by weights other than `version`
    (--mask-offpolicy-in-partial-rollout: the part of a continued answer that older weights
    wrote); returns how many tokens were masked."""
    masked = 0
    for row, s in enumerate(samples):
        first = len(s.prompt_ids) - 1  # target column of the first response token
        for i, (v, trained) in enumerate(zip(s.weight_versions or [], s.mask(), strict=False)):
            if v != version and trained:  # a tool's tokens are out of the loss already
                batch.loss_mask[row, first + i] = 0.0
                masked += 1
    return masked
