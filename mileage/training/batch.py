"""Packs scored samples into the padded tensors the trainer consumes.

Sequences are prompt + response, right-padded. Everything per-token lives in "target" space:
position i of `targets`, `loss_mask`, `old_logprobs`, ... refers to token i+1 of the sequence,
the token predicted by the logits at position i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    loss_mask: torch.Tensor  # [N, L-1] float, 1 on response tokens
    old_logprobs: torch.Tensor  # [N, L-1] generating policy
    rewards: torch.Tensor  # [N]
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed to the longest sequence among them."""
        width = int(self.attention_mask[start:stop].sum(dim=1).max())

        def cut(t: torch.Tensor | None, w: int) -> torch.Tensor | None:
            return None if t is None else t[start:stop, :w]

        return TrainBatch(
            input_ids=cut(self.input_ids, width),
            attention_mask=cut(self.attention_mask, width),
            loss_mask=cut(self.loss_mask, width - 1),
            old_logprobs=cut(self.old_logprobs, width - 1),
            rewards=self.rewards[start:stop],
            ref_logprobs=cut(self.ref_logprobs, width - 1),
            advantages=cut(self.advantages, width - 1),
        )


def pack_samples(samples, pad_id: int) -> TrainBatch:
    """Samples (with prompt_ids, response_ids, logprobs, reward) -> a right-padded TrainBatch."""
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
        loss_mask[row, p - 1 : p + r - 1] = 1.0
        old_logprobs[row, p - 1 : p + r - 1] = torch.tensor(s.logprobs)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return TrainBatch(input_ids, attention_mask, loss_mask, old_logprobs, rewards)
