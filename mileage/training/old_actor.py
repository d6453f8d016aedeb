"""`--keep-old-actor` (miles' flag): the trainer keeps the weights the engine generated with.

In async training a sample can come from weights several updates older than the trainer's. With
`--keep-old-actor` the trainer keeps a copy of each such weight version (the versions that still
have generated-but-untrained groups, and the one the engine holds now) and recomputes the PPO
ratio's denominator, the "old" log-probs, with the weights that generated each row:

    r_t = pi_theta(y_t | x, y_<t) / pi_old(y_t | x, y_<t),   pi_old = the behaviour weights,
                                                             evaluated by the trainer

so PPO's clip and ratio are taken against the policy that actually sampled the tokens, in the
trainer's own numerics (the engine's log-probs of the same weights differ by kernels and
precision; `--use-tis` can correct that remainder as in synchronous training).

Only parameters that train are copied (with LoRA: the adapter); frozen ones are the same in
every version. The copies are state: a checkpoint holds those its rollout buffer needs, so a
resumed run recomputes the same denominators bit for bit.

A version is recomputed with the policy itself, its trained parameters swapped for the kept ones
and put back after (no second model in memory). Under torchrun the kept copies are the whole
tensors (gathered once per version, the same on every rank, so rank 0 checkpoints them as in one
process), and each rank swaps in its shard of them: how to gather a parameter and how to swap
are the distributed layer's (`gather`, `swap`: `mileage.distributed.parallelize`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager

import torch

from mileage.training.batch import TrainBatch
from mileage.training.mismatch import trainer_logprobs

SEPARATOR = "/"  # checkpoint keys: "<version>/<parameter name>"


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters training changes, by name (each shared parameter once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


Swap = Callable[[torch.nn.Module, dict[str, torch.Tensor]], AbstractContextManager]


class OldActor:
    """Weight versions (keyed by trained rollouts) kept on the trainer, in CPU memory.

    `gather(parameter)`: its whole value (a collective under torchrun); `swap(model, values)`:
    a context in which `model` computes with `values` instead of its own parameters."""

    def __init__(self, gather: Callable[[torch.Tensor], torch.Tensor], swap: Swap) -> None:
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.gather, self.swap = gather, swap

    def keep(self, version: int, model: torch.nn.Module) -> None:
        """Copy the model's trainable weights now as `version` (the engine just received them);
        under torchrun every rank calls it at the same point."""
        self.versions[version] = {
            name: self.gather(p.detach()).to("cpu", copy=True)
            for name, p in trainable_tensors(model).items()
        }

    def prune(self, needed: Iterable[int]) -> None:
        """Forget versions no untrained group and no future generation can come from."""
        needed = set(needed)
        for version in [v for v in self.versions if v not in needed]:
            del self.versions[version]

    def missing(self, versions: Iterable[int]) -> list[int]:
        return sorted(set(versions) - set(self.versions))

    def state_tensors(self, versions: Iterable[int]) -> dict[str, torch.Tensor]:
        """The kept weights of `versions`, flat for a safetensors file."""
        return {
            f"{v}{SEPARATOR}{name}": tensor
            for v in sorted(set(versions))
            for name, tensor in self.versions[v].items()
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            version, name = key.split(SEPARATOR, 1)
            self.versions.setdefault(int(version), {})[name] = tensor

    @torch.no_grad()
    def logprobs(
        self, actor, batch: TrainBatch, row_versions: Sequence[int], current: int
    ) -> torch.Tensor:
        """Each row's log-probs under the weights that generated it (`row_versions`), computed
        exactly as the trainer computes its own (`trainer_logprobs`). Rows of version `current`
        (the trainer's weights now) use the actor's model itself."""
        out = torch.zeros_like(batch.old_logprobs)
        rows_of: dict[int, list[int]] = {}
        for row, version in enumerate(row_versions):
            rows_of.setdefault(version, []).append(row)
        for version, rows in sorted(rows_of.items()):
            if version == current:
                computed = trainer_logprobs(actor, batch)
            else:
                with self.swap(actor.model, self._weights(actor.model, version)) as model:
                    computed = trainer_logprobs(actor, batch, model=model)
            # the whole batch per version (usually one), so the micro-batches, and with them
            # the numerics, are the trainer's own; then the rows of that version are kept
            index = torch.tensor(rows, device=out.device)
            out[index] = computed[index]
        return out

    def _weights(self, model: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
        weights, params = self.versions[version], trainable_tensors(model)
        if set(weights) != set(params):
            raise RuntimeError(
                f"old actor version {version} holds other parameters than the policy "
                f"({sorted(set(weights) ^ set(params))[:3]}...)"
            )
        return weights
