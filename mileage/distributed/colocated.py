"""`--colocate` under torchrun: one vLLM engine in every rank's process.

vLLM started in a process whose torch.distributed is initialized does not make a world of its
own: it builds its process groups from the trainer's (`new_group` over every rank, a collective).
An engine on rank 0 alone therefore waits forever for the other ranks (measured with vLLM 0.32
on the CPU). So every rank starts one, as vLLM's `external_launcher` expects (each rank a
data-parallel replica of the whole model, as TRL's colocate mode runs it): on GPUs that is one
engine beside each rank's trainer shard, on its own device.

- Weights: every rank takes part in gathering each tensor's full value (`DTensor.full_tensor`,
  one all-gather per tensor) and hands them to its own engine: vLLM is loaded once from them
  written to a directory of the rank's own, then every update goes to the reloader in memory.
- Generation: each rank samples its share of the rows, each row with its own seed keyed by its
  index in the whole call (`RowsOf`), so a row's sample does not depend on the rank that drew
  it; then every rank gathers all completions, as the in-process engine's ranks do.
- LoRA: every rank merges W + scale * B @ A from the gathered full values (vLLM here is given
  no adapter), as one process syncs merged weights to it.
- Tools, generate functions and rollout functions would run on every rank here (refused, as
  for the in-process engine under torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mileage.distributed import env
from mileage.distributed.lora_remote import merged_full_values
from mileage.distributed.parallelize import full_value
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.colocated import model_state


@dataclass(frozen=True)
class RowsOf:
    """The seeds of rows `rows` of an engine call, for the part of it this rank generates."""

    seed: object  # a SamplingSeed or RowSeeds of the whole call
    rows: tuple[int, ...]

    def row_seed(self, row: int) -> int:
        return self.seed.row_seed(self.rows[row])


class ColocatedOnEveryRank:
    """The `Engine` interface over all ranks, each with its own colocated vLLM engine."""

    in_process = False  # vLLM's kernels: the trainer recomputes the log-probs

    def __init__(self, engine, lora=None):
        self.engine = engine
        self.lora = lora  # a LoRA run's policy: the engine gets merged weights
        engine.external_launcher = True  # vLLM joins the trainer's process group

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        """Every rank gathers every full value (a collective per tensor, in the same order on
        all ranks) before its engine sees any, so no rank's engine can fail between two of
        them and leave the others waiting."""
        if self.lora is not None:  # vLLM here takes no adapter: W + scale * B @ A
            state = merged_full_values(self.lora.model)
        else:
            state = {name: full_value(t.detach()) for name, t in model_state(model).items()}
        self.engine.load_full(model.config, state, version, f"rank{env.rank()}")

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed=None,
        group_size: int = 1,
    ) -> list[Completion]:
        mine = env.share(len(prompts))
        part = None if seed is None else RowsOf(seed, tuple(mine))
        local = self.engine.generate([prompts[i] for i in mine], params, part, group_size)
        return [c for share in env.all_gather_object(local) for c in share]

    def release(self) -> None:
        self.engine.release()

    def close(self) -> None:
        # vLLM's shutdown destroys the process group it joined: the ranks finish together first
        if dist.is_initialized():
            dist.barrier()
        self.engine.close()
