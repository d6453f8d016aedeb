"""Generation at world size N: each rank samples its share of the prompts, then all ranks
gather every completion, so advantages (computed on every rank) see whole groups.

The engine decodes with the sharded policy itself: for each `generate` call every rank gathers
the full parameters once (`parallelize.unsharded`, one all-gather per sharded module), decodes
its share without communicating per token, and frees them again. Between rollouts a rank holds
only its shards, and the full values are exactly what `DTensor.full_tensor()` gives, so the
samples are those a plain full copy of the policy drew (which an earlier version kept on every
rank for the whole run).

Under `--fsdp-mixed-precision bf16` FSDP's gathered parameters are bf16, so the engine keeps a
plain fp32 copy there (refreshed by `update_weights` with one all-gather per tensor per
rollout): generating from the bf16 parameters would change the samples of such runs, and FSDP
bf16 cannot run on the CPU to check what it changes. The loss then computes in bf16 while the
copy decodes in fp32, so the engine is not `in_process`: the trainer recomputes the old
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
from mileage.distributed.parallelize import copy_full_weights, unsharded
from mileage.rollout.engine import Completion, LocalEngine, SamplingParams


class ShardedGenerationEngine:
    """The `Engine` interface over all ranks of the process group, around a `LocalEngine`."""

    def __init__(self, engine: LocalEngine, group_size: int, loss_precision_matches: bool = True):
        # decodes with engine.model: the sharded policy (gathered per call) or, under bf16
        # mixed precision, a plain fp32 copy of it
        self.engine = engine
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
        if self.engine.model is not model:  # the plain copy: refresh it from the shards
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
        with unsharded(self.engine.model):
            local = self._generate_share(prompts, params, generator)
        return [c for part in env.all_gather_object(local) for c in part]

    def _generate_share(
        self, prompts: list[list[int]], params: SamplingParams, generator
    ) -> list[Completion]:
        if params.greedy or generator is None or isinstance(generator, list):
            # a generator per row (RowSeeds) makes a row's sample independent of the rank
            mine = env.share(len(prompts))
            part = [generator[i] for i in mine] if isinstance(generator, list) else generator
            return self.engine.generate([prompts[i] for i in mine], params, part)
        return self._sample_groups(prompts, params, generator)

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
