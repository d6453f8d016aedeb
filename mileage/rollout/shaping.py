"""Length handling of DAPO and TRL for `mileage train`: overlong reward shaping and masking of
truncated answers.

Overlong shaping (DAPO; verl's `overlong_buffer.len` / `.penalty_factor`): with L the maximum
response length and B the buffer, an answer of n tokens gets
    reward + min(-(n - (L - B)) / B * factor, 0),
no penalty up to L - B tokens, growing linearly to `factor` at L. Only the trained reward (the
advantages) is shaped; the dynamic-sampling filter, accuracy and `reward_mean` see the task's
own reward, as DAPO filters groups on accuracy.

Truncation masking (TRL's `mask_truncated_completions`): an answer that hit the length limit
without an end-of-sequence token still counts in its group's advantage statistics but none of
its tokens is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.rollout import Sample


@dataclass
class ShapingConfig:
    overlong_buffer_len: int = option(
        0,
        "DAPO overlong reward shaping (verl's overlong_buffer.len): answers longer than "
        "--rollout-max-response-len minus this many tokens lose reward linearly; 0 disables",
    )
    overlong_penalty_factor: float = option(
        1.0, "the overlong penalty at --rollout-max-response-len (verl's penalty_factor)"
    )
    mask_truncated_completions: bool = option(
        False, "leave answers cut off at the length limit (no EOS) out of the loss (TRL's)"
    )

    def validate(self, max_response_len: int) -> None:
        if not 0 <= self.overlong_buffer_len <= max_response_len:
            raise UserError(
                f"--overlong-buffer-len must be in [0, --rollout-max-response-len "
                f"{max_response_len}], got {self.overlong_buffer_len}"
            )
        if self.overlong_penalty_factor < 0:
            raise UserError(
                f"--overlong-penalty-factor must be >= 0, got {self.overlong_penalty_factor}"
            )


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment of an answer of `length` tokens (<= 0)."""
    exceed = length - (max_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


def shape_rewards(samples: list[Sample], cfg: ShapingConfig, max_len: int) -> list[Sample]:
    """The samples with the overlong penalty added to their rewards (themselves when off)."""
    if not cfg.overlong_buffer_len:
        return samples
    return [
        replace(
            s,
            reward=s.reward
            + overlong_penalty(
                len(s.response_ids), max_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            ),
        )
        for s in samples
    ]
