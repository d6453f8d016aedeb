"""When a run saves: decided at rollout boundaries, said in the plan before anything trains.

With `--save` and no `--save-interval`, a run saves whenever a tenth of its rollouts or
`--save-interval-minutes` (default 5) of work have passed since its last save, whichever comes
first, and after its last rollout: a kill anywhere loses at most that much. Saving reads state
and never changes it, so the trajectory (and every checkpoint's bits) is the same whatever the
clock decides. `--save-interval N` is miles' meaning: every N rollouts and after the last.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_MINUTES = 5.0
DEFAULT_SHARE = 10  # a tenth of the run


@dataclass
class SaveSchedule:
    num_rollout: int
    every: int | None  # rollouts between saves, counted from rollout 0; None: the last only
    minutes: float = 0.0  # also save once this much work is unsaved; 0: never by the clock
    # the ranks of a torchrun job agree on the clock's answer (any rank due: all save)
    agree: Callable[[bool], bool] = lambda due: due
    automatic: bool = False  # the interval is the default's (a tenth of the run)
    _last_save: float = field(default_factory=lambda: time.monotonic())

    def due(self, rollout_id: int) -> bool:
        """Whether the checkpoint after `rollout_id` is due."""
        if rollout_id == self.num_rollout - 1:
            return True
        if self.every is not None and (rollout_id + 1) % self.every == 0:
            return True
        if not self.minutes:
            return False
        return self.agree(time.monotonic() - self._last_save >= self.minutes * 60)

    def saved(self) -> None:
        self._last_save = time.monotonic()

    def describe(self) -> str:
        """The plan's line: when this run saves."""
        rules = []
        if self.every is not None:
            why = f"a tenth of {self.num_rollout}" if self.automatic else "--save-interval"
            rules.append(f"every {self.every} rollout(s) ({why})")
        if self.minutes:
            rules.append(f"after {self.minutes:g} min of unsaved work (--save-interval-minutes)")
        first = " or ".join(rules) + (", whichever comes first" if len(rules) > 1 else "")
        return f"  saves: {first + ', and ' if rules else ''}after the last rollout"


def build_schedule(
    num_rollout: int,
    save_interval: int | None,
    save_interval_minutes: float | None,
    agree: Callable[[bool], bool] = lambda due: due,
) -> SaveSchedule:
    """The schedule of a run with `--save`; see the module docstring for the defaults."""
    if save_interval is not None:
        return SaveSchedule(num_rollout, save_interval, save_interval_minutes or 0.0, agree)
    minutes = DEFAULT_MINUTES if save_interval_minutes is None else save_interval_minutes
    every = max(1, math.ceil(num_rollout / DEFAULT_SHARE))
    return SaveSchedule(num_rollout, every, minutes, agree, automatic=True)
