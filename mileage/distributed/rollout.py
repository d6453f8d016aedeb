"""Generation at world size N: each rank samples its share of the prompts, then all ranks
gather every completion, so advantages (computed on every rank) see whole groups.

The engine decodes with a plain, unsharded copy of the policy: `update_weights` all-gathers each
sharded tensor into it once per rollout (`copy_full_weights`), so decoding needs no
communication per token. The copy holds fp32 weights; under `--fsdp-mixed-precision bf16` the
loss computes in bf16, so the engine is then not `in_process`: the trainer recomputes the old
log-probs with the sharded bf16 model (`mismatch.apply_mismatch`) and logs the difference.

Sampled rollouts are split by group (the `n_samples_per_prompt` answers to one prompt). Each
group draws from its own generator, seeded by the group's index from the rollout's generator,
so which rank samples a group does not change its tokens: with the same weights a group's
samples are the same at any world size > 1. (The single-process engine samples the whole rollout
as one batch from one generator, which is faster but ties every draw to the batch; that path is
kept as it was.) Greedy decoding (evaluation) draws nothing, so its rows are split evenly.
"""

from __future__ import annotations

import torch

from mileage.distributed import env
from mileage.distributed.parallelize import copy_full_weights
from mileage.rollout.engine import Completion, LocalEngine, SamplingParams


class ShardedGenerationEngine:
    """The `Engine` interface over all ranks of the process group, around a `LocalEngine`."""

    def __init__(self, engine: LocalEngine, group_size: int, loss_precision_matches: bool = True):
        self.engine = engine  # holds the plain full-weight copy
        self.group_size = group_size
        # True: the copy computes in the loss's precision, so its log-probs are the old policy's.
        # With --fsdp-mixed-precision bf16 the loss runs in bf16 while the copy decodes in fp32:
        # the trainer must recompute the old log-probs (and logs logprob_abs_diff), or the PPO
        # ratio is not 1 at the first step of a rollout.
        self.in_process = loss_precision_matches

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, model: torch.nn.Module, version: int = 0) -> None:
        copy_full_weights(model, self.engine.model)
        self.engine.weight_version = version

    def close(self) -> None:
        self.engine.close()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed=None,
        group_size: int = 1,
    ) -> list[Completion]:
        """`seed` as for `LocalEngine.generate` (a `SamplingSeed`, a generator or None)."""
        generator = seed.generator() if hasattr(seed, "generator") else seed
        if params.greedy or generator is None or isinstance(generator, list):
            # a generator per row (RowSeeds) makes a row's sample independent of the rank
            mine = env.share(len(prompts))
            part = [generator[i] for i in mine] if isinstance(generator, list) else generator
            local = self.engine.generate([prompts[i] for i in mine], params, part)
        else:
            local = self._sample_groups(prompts, params, generator)
        return [c for part in env.all_gather_object(local) for c in part]

    def _sample_groups(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[Completion]:
        size = self.group_size if len(prompts) % self.group_size == 0 else 1
        groups = len(prompts) // size
        # every rank draws all group seeds, so a group's seed does not depend on the world size
        seeds = torch.randint(0, 2**62, (groups,), generator=generator).tolist()
        local: list[Completion] = []
        for group in env.share(groups):
            rows = prompts[group * size : (group + 1) * size]
            local += self.engine.generate(rows, params, torch.Generator().manual_seed(seeds[group]))
        return local
