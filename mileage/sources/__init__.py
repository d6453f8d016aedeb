"""Rollout sources: where a rollout's scored samples come from.

The driver (`mileage.loop`) runs one per-rollout body for every run; a source decides which
weights generated the samples it hands over and how the trainer corrects for them:

- `OnPolicySource` (`mileage train`): generates each rollout with the trainer's current
  weights, when the loop asks (plain, dynamic sampling, partial rollout, a user rollout
  function, replayed debug data);
- `AheadSource` (`mileage train-async`): generates slots in a background thread with the
  weights a fixed schedule gives them, ahead of training, and corrects for their age;
- `DatasetSource` (`mileage sft`): the data records' own answers; nothing generates.

A new way of producing samples (a teacher, an agent endpoint) is a new source, never a branch
in the loop. A source's state goes into the rollout's checkpoint in the same commit as the
rest: what has a `state_dict` (a rollout buffer) is registered in the run's `parts` when the
source is built, before the restore; tensors (train-async's kept old weights) through
`checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mileage.checkpoint.store import CheckpointState
    from mileage.components import Run
    from mileage.training.batch import TrainBatch


@dataclass
class Drawn:
    """One rollout's samples and how they were found."""

    prompts: list
    samples: list
    stats: dict = field(default_factory=dict)  # logged with the rollout (sampling, staleness)
    groups: list | None = None  # the ahead source's groups, with the weights each came from


class RolloutSource(Protocol):
    def start(self) -> None:
        """After the run is restored and the engine holds its weights: restore own state."""

    def draw(self, rollout_id: int) -> Drawn:
        """Rollout `rollout_id`'s scored samples."""

    def correct(self, batch: TrainBatch, drawn: Drawn, rollout_id: int) -> dict:
        """Correct `batch` for the weights that generated it; returns the metrics to log."""

    def after_train(self, rollout_id: int, drawn: Drawn) -> tuple[bool, dict]:
        """Hand the trained weights to the generator as scheduled; returns whether the engine
        now holds them (evaluation generates with it) and what to add to the rollout's record."""

    def checkpoint(self, state: CheckpointState) -> CheckpointState:
        """`state` with this source's own tensors in it."""

    def close(self) -> None: ...


def release_engine(run: Run) -> None:
    """The rollout's samples are drawn: an engine that can give its memory to training until
    the next update (colocated vLLM's sleep mode) does so."""
    release = getattr(run.engine, "release", None)
    if release is not None:
        release()


def sync_engine(run: Run) -> None:
    """Hand the trainer's weights to the engine; their version is the optimizer step."""
    if run.engine is not None:
        run.engine.update_weights(run.model, run.actor.step)


def build_source(run: Run, asynchronous: bool, supervised: bool = False) -> RolloutSource:
    """The source of `mileage train-async` (ahead), `mileage sft` (the dataset's own answers)
    or `mileage train` (on-policy)."""
    if supervised:
        from mileage.sources.dataset import DatasetSource

        return DatasetSource(run)
    if asynchronous:
        from mileage.sources.ahead import AheadSource

        return AheadSource(run)
    from mileage.sources.on_policy import OnPolicySource

    return OnPolicySource(run)
