"""The interface every rollout engine implements, and the seeds it samples with.

The loop never learns which engine it has: it calls `generate`, `update_weights` and `close`
on whatever `build_engine` returned. Token ids go in, and each completion comes back with the
log-probs of its sampled tokens and the weight version that generated it.

Seeding. Sampling for rollout N is a pure function of `(seed, N)`: the in-process engine draws
every row from one generator, `generator_for(seed, "rollout", N)` (the arithmetic the project's
numbers were measured with); a remote engine sends row i the seed `row_seed(i)`, so a row's
sample does not depend on which server generated it, on what was batched with it, or on retries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.http import BadReply
from mileage.seeding import derive_seed, generator_for

__all__ = ["Completion", "Engine", "RowSeeds", "SamplingParams", "SamplingSeed"]

# remote row seeds fit a signed 32-bit integer
ROW_SEED_MASK = (1 << 31) - 1


@dataclass(frozen=True)
class SamplingSeed:
    """Where the randomness of one rollout's sampling comes from."""

    seed: int
    rollout_id: int
    # what is sampled: training's rollouts, or an evaluation ("eval/NAME", rollout/evaluation.py),
    # so the two never draw the same numbers
    purpose: str = "rollout"

    def generator(self) -> torch.Generator:
        """One generator for the whole rollout (the in-process engine)."""
        return generator_for(self.seed, self.purpose, self.rollout_id)

    def row_seed(self, row: int) -> int:
        """The seed of sample `row` of the rollout (remote engines: SGLang's `sampling_seed`,
        vLLM's `seed`), keyed on (seed, purpose, rollout id, row). 31 bits: some SGLang builds keep
        seeds in an int32 tensor, which a larger value overflows (the scheduler crashes)."""
        return (
            derive_seed(self.seed, f"{self.purpose}/{self.rollout_id}/sample", row) & ROW_SEED_MASK
        )


@dataclass(frozen=True)
class RowSeeds:
    """One seed per row of an engine call, each a pure function of its own key (multi-turn
    rollouts: `mileage.rollout.client`), so a row's sample depends on nothing batched with it.
    The in-process engine draws row i from `generator()[i]`; remote engines send `row_seed(i)`."""

    seeds: tuple[int, ...]

    def generator(self) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(s) for s in self.seeds]

    def row_seed(self, row: int) -> int:
        return self.seeds[row] & ROW_SEED_MASK


def check_sample(
    tokens: list[int], logprobs: list[float], finish: str, max_new_tokens: int, vocab_size: int
) -> None:
    """Refuse (BadReply: the request is retried elsewhere) a remote engine's sample that the
    trainer cannot use: one log-prob per token, 1..max_new_tokens tokens of the vocabulary,
    log-probs that are finite and <= 0 (up to float noise), and a known finish reason."""
    if len(tokens) != len(logprobs) or not 1 <= len(tokens) <= max_new_tokens:
        raise BadReply(
            f"{len(tokens)} tokens, {len(logprobs)} log-probs for max_new_tokens {max_new_tokens}"
        )
    if any(not 0 <= t < vocab_size for t in tokens):
        raise BadReply("token id outside the vocabulary")
    if any(not math.isfinite(lp) or lp > 1e-4 for lp in logprobs):
        raise BadReply("a log-prob is not a finite number <= 0")
    if finish not in ("stop", "length"):
        raise BadReply(f"finish_reason {finish!r}")


class Engine(Protocol):
    """A generator of completions that follows the trainer's weights."""

    # True when the log-probs come from the trainer's own module (no recompute needed)
    in_process: bool
    # the version of the weights the engine was last given (the trainer's optimizer step)
    weight_version: int

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: SamplingSeed | RowSeeds | None = None,
        group_size: int = 1,
    ) -> list[Completion]:
        """One completion per prompt, in order; prompts come in groups of `group_size`
        consecutive copies (the samples of one prompt), which a remote engine keeps together."""
        ...

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        """Make the engine generate with `model`'s current weights, labelled `version`."""
        ...

    def close(self) -> None:
        """Release servers, processes and files the engine holds."""
        ...
