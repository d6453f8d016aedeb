"""The rollout buffer of async training: groups generated ahead of the trainer, checkpointed.

A group is the `n_samples_per_prompt` samples of one prompt. Slots of generation (one rollout's
worth of prompts each, see `mileage.async_config`) are appended in submission order, never
completion order, and the trainer takes groups from the front. What the buffer holds when a
checkpoint is written (every group generated with weights older than the checkpoint's) goes into
the trainer state JSON of the same atomic commit: token ids, log-probs, rewards and per-token
weight versions, floats written with repr so they load back bit for bit. The data position the
buffered groups consumed is the data source's own state, saved beside it.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from mileage.rollout.prompts import Prompt
from mileage.rollout.rollout import inadmissible
from mileage.rollout.sample import Sample

STATE_KEY = "rollout_buffer"


@dataclass
class Group:
    slot: int  # the generation slot it came from (its sampling seed)
    policy_rollouts: int  # rollouts trained into the weights that generated it
    samples: list[Sample]

    @property
    def prompt(self) -> Prompt:
        return self.samples[0].prompt


def split_groups(slot: int, policy_rollouts: int, samples: list[Sample], n: int) -> list[Group]:
    """A finished slot's groups: its samples, `n` consecutive per prompt."""
    return [Group(slot, policy_rollouts, samples[i : i + n]) for i in range(0, len(samples), n)]


class RolloutBuffer:
    """Generated-but-untrained groups in submission order, plus what the producer owes."""

    # a checkpoint of a run without a buffer (plain `mileage train`) resumes with an empty one
    optional_in_checkpoint = True

    def __init__(self) -> None:
        self.groups: deque[Group] = deque()
        self.next_slot = 0  # the next slot to submit
        self.retry: list[Prompt] = []  # prompts of stale groups to generate again, in order
        self.dropped = 0  # groups dropped or sent back as stale, over the whole run
        # --partial-rollout: groups still being generated when their rollout had its batch
        # (aborted), oldest first; their samples keep their tokens and per-token weight versions
        # and continue from there in a later sampling round
        self.partial: deque[Group] = deque()
        # train-async with --dynamic-sampling-filter-path: groups the filter dropped as their
        # slot was collected, by reason, over the whole run
        self.filtered: dict[str, int] = {}

    def take(
        self, count: int, trained: int, max_staleness: int | None, handler: str
    ) -> tuple[list[Group], list[Group]]:
        """Up to `count` admitted groups from the front, for the trainer that has trained
        `trained` rollouts, and the stale ones passed over on the way (dropped, or with
        handler "retry" their prompts queued to be generated again)."""
        taken: list[Group] = []
        stale: list[Group] = []
        while self.groups and len(taken) < count:
            group = self.groups.popleft()
            if inadmissible([group.policy_rollouts], trained, max_staleness) is None:
                taken.append(group)
                continue
            stale.append(group)
            self.dropped += 1
            if handler == "retry":
                self.retry.append(group.prompt)
        return taken, stale

    def draw_retries(self, size: int) -> list[Prompt]:
        """Up to `size` prompts owed a new generation, oldest first."""
        owed, self.retry = self.retry[:size], self.retry[size:]
        return owed

    def state_dict(self) -> dict:
        state = {
            "next_slot": self.next_slot,
            "dropped": self.dropped,
            "retry": [asdict(p) for p in self.retry],
            "groups": [_group_state(g) for g in self.groups],
        }
        if self.partial:  # only then: checkpoints without partial rollout keep their bytes
            state["partial"] = [_group_state(g) for g in self.partial]
        if self.filtered:  # likewise without a filter
            state["filtered"] = dict(sorted(self.filtered.items()))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.next_slot = int(state["next_slot"])
        self.dropped = int(state["dropped"])
        self.retry = [Prompt(**p) for p in state["retry"]]
        self.groups = deque(_load_group(g) for g in state["groups"])
        self.partial = deque(_load_group(g) for g in state.get("partial", []))
        self.filtered = {str(k): int(v) for k, v in state.get("filtered", {}).items()}


def _group_state(group: Group) -> dict:
    return {
        "slot": group.slot,
        "policy_rollouts": group.policy_rollouts,
        "samples": [s.to_record() for s in group.samples],
    }


def _load_group(state: dict) -> Group:
    return Group(
        state["slot"],
        state["policy_rollouts"],
        [Sample.from_record(s) for s in state["samples"]],
    )


def describe_saved(checkpoint: str | Path, trainer_state: str) -> str | None:
    """What a resume from `checkpoint` reuses, in one line; None when it holds no buffer."""
    path = Path(checkpoint) / trainer_state
    if not path.is_file():
        return None
    state = json.loads(path.read_text()).get(STATE_KEY)
    if not state:
        return None
    groups = state["groups"]
    slots = sorted({g["slot"] for g in groups})
    samples = sum(len(g["samples"]) for g in groups)
    versions = sorted(
        {v for g in groups for s in g["samples"] for v in (s.get("weight_versions") or [])}
    )
    what = (
        f"{len(slots)} pre-generated rollout{'s' if len(slots) != 1 else ''} "
        f"({samples} samples, weight version{'s' if len(versions) != 1 else ''} "
        f"{', '.join(map(str, versions)) or 'unknown'})"
        if groups
        else "no pre-generated rollouts"
    )
    retry = f", {len(state['retry'])} prompts to generate again" if state["retry"] else ""
    partial = state.get("partial", [])
    if partial:
        retry += f", {len(partial)} partially generated groups to continue"
    return f"  reuses {what}{retry}; next generation slot {state['next_slot']}"
