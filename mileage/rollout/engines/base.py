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

from dataclasses import dataclass
from typing import Protocol

import torch

from mileage.rollout.engine import Completion, SamplingParams
from mileage.seeding import derive_seed, generator_for

__all__ = ["Completion", "Engine", "SamplingParams", "SamplingSeed"]

# remote row seeds fit a signed 32-bit integer
ROW_SEED_MASK = (1 << 31) - 1


@dataclass(frozen=True)
class SamplingSeed:
    """Where the randomness of one rollout's sampling comes from."""

    seed: int
    rollout_id: int

    def generator(self) -> torch.Generator:
        """One generator for the whole rollout (the in-process engine)."""
        return generator_for(self.seed, "rollout", self.rollout_id)

    def row_seed(self, row: int) -> int:
        """The seed of sample `row` of the rollout (remote engines: SGLang's `sampling_seed`,
        vLLM's `seed`), keyed on (seed, rollout id, row). 31 bits: some SGLang builds keep
        seeds in an int32 tensor, which a larger value overflows (the scheduler crashes)."""
        return derive_seed(self.seed, f"rollout/{self.rollout_id}/sample", row) & ROW_SEED_MASK


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
        seed: SamplingSeed | None = None,
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
