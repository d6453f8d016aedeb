"""The registry of a run's checkpointed parts: each part with state is registered once, under
the key its state has in the checkpoint's trainer state, and saving and restoring loop over the
registry instead of naming the parts (torchtitan's checkpointer holds its `states` the same
way, without knowing what is in them).

A part restores with a group of the plan: "run" parts on every resume (the actor's counters),
"data" parts with the data position (the data source, and the rollout buffers whose groups
hold prompts it already handed out), "critic" parts when the plan restores the critic. The
bytes a part loads were verified with the whole checkpoint before anything loaded
(`build.verify_sources`). Tensor parts (weights, optimizer, RNG, kept old weights) have
files of their own, written and verified by `checkpoint.store`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mileage.errors import UserError

RUN, DATA, CRITIC = "run", "data", "critic"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Recorded:
    """A part whose state is only recorded, never restored through the registry (read when
    the run is built, as the W&B run id its trackers continue)."""

    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class StateRegistry:
    def __init__(self) -> None:
        self._parts: dict[str, tuple[Stateful, str]] = {}

    def register(self, key: str, part: Stateful, restores_with: str = RUN) -> None:
        if key in self._parts:
            raise ValueError(f"checkpoint part {key!r} registered twice")
        self._parts[key] = (part, restores_with)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state, in registration order."""
        return {key: part.state_dict() for key, (part, _) in self._parts.items()}

    def load_state_dict(self, state: dict[str, Any], groups: set[str], where: str) -> None:
        """Restore the parts of `groups` from a checkpoint's trainer `state` (read from
        `where`); a part the checkpoint lacks is refused, unless it is `optional_in_checkpoint`."""
        for key, (part, group) in self._parts.items():
            if group not in groups or isinstance(part, Recorded):
                continue
            if key not in state:
                if getattr(part, "optional_in_checkpoint", False):
                    continue  # e.g. a buffer that a checkpoint of another kind of run lacks
                raise UserError(
                    f"{where} has no {key!r} in its trainer state; it was not written by a run "
                    "of this kind (resume with the command and flags that wrote it)"
                )
            part.load_state_dict(state[key])
