"""The registry of checkpointed parts (`mileage.checkpoint.registry`): save and restore loop over
what was registered, by the plan's groups. Unit-level, with fake parts; the resume and crash
tests cover the real parts end to end."""

from __future__ import annotations

import pytest

from mileage.checkpoint.registry import CRITIC, DATA, RUN, Recorded, StateRegistry
from mileage.errors import UserError


class Counter:
    def __init__(self, value: int = 0, optional: bool = False):
        self.value = value
        self.optional_in_checkpoint = optional

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def registry(**parts) -> StateRegistry:
    out = StateRegistry()
    for key, (part, group) in parts.items():
        out.register(key, part, group)
    return out


def test_state_is_every_part_in_registration_order_and_restores_by_group():
    actor, data, critic = Counter(3), Counter(5), Counter(7)
    saved = registry(actor=(actor, RUN), data=(data, DATA), critic=(critic, CRITIC))
    state = saved.state_dict()
    assert list(state) == ["actor", "data", "critic"]

    fresh = [Counter(), Counter(), Counter()]
    restored = registry(actor=(fresh[0], RUN), data=(fresh[1], DATA), critic=(fresh[2], CRITIC))
    restored.load_state_dict(state, {RUN, DATA}, "iter_0000003")  # e.g. --no-load-critic
    assert [p.value for p in fresh] == [3, 5, 0]


def test_a_missing_part_is_one_line_unless_it_is_optional():
    state = {"actor": {"value": 1}}
    with pytest.raises(UserError, match=r"iter_0000001 has no 'data' in its trainer state"):
        registry(actor=(Counter(), RUN), data=(Counter(), DATA)).load_state_dict(
            state, {RUN, DATA}, "iter_0000001"
        )
    buffer = Counter(9, optional=True)  # a buffer a checkpoint of another kind of run lacks
    registry(actor=(Counter(), RUN), rollout_buffer=(buffer, DATA)).load_state_dict(
        state, {RUN, DATA}, "iter_0000001"
    )
    assert buffer.value == 9


def test_recorded_parts_are_saved_never_restored_and_keys_are_unique():
    parts = StateRegistry()
    parts.register("tracking", Recorded({"wandb_run_id": "abc"}))
    assert parts.state_dict() == {"tracking": {"wandb_run_id": "abc"}}
    parts.load_state_dict({}, {RUN}, "iter_0000000")  # nothing to restore: no error
    with pytest.raises(ValueError, match="registered twice"):
        parts.register("tracking", Recorded({}))
