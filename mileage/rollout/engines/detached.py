"""The in-process engine with weights of its own, for async training.

`mileage train` generates with the trainer's own module, which holds still while it generates.
`mileage train-async` generates rollout N+1 in a background thread while rollout N trains, so
the engine needs a copy that training does not change mid-generation; `update_weights` copies
the trainer's weights into it, which the driver only does while nothing generates.
"""

from __future__ import annotations

import copy

import torch

from mileage.faults import fault_point
from mileage.rollout.engine import LocalEngine


class DetachedLocalEngine(LocalEngine):
    """A `LocalEngine` over a private copy of the model, refreshed by copying."""

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int):
        # requires_grad stays as the trainer's: with it off, CPU matmuls take another kernel
        # and the log-probs differ in the last bits from the trainer's module (and from `train`)
        own = copy.deepcopy(model).eval()
        super().__init__(own, pad_id, eos_id)

    def update_weights(self, model: torch.nn.Module, version: int = 0) -> None:
        mine = self.model.state_dict()
        theirs = model.state_dict()
        names = list(mine)
        with torch.no_grad():
            for number, name in enumerate(names):
                if number == len(names) // 2:
                    fault_point("mid_weight_sync")  # half the tensors copied
                mine[name].copy_(theirs[name])
        self.weight_version = version
