"""Rewards that may answer differently when asked again, journaled with the rollout.

An LLM judge samples, a reward server may be redeployed, a user's function may call either. A
run killed after scoring a rollout and rerun generates that rollout again (its tokens are exact)
and would score it again: with another answer it would train on other rewards and leave the
uninterrupted run's trajectory. So the rewards of such a function are appended to the run's
journal (`mileage.rollout.journal`, the slot of the generation round) in one fsynced line before
the rollout uses them, and a rerun reads them back.

Each entry is keyed by the sample's place in the round and carries a digest of the sample
(prompt, label, response ids and text): a recorded reward is used only for the very sample it
was given to, and only when the whole round's are there (a kill inside the write loses the
line, and the round is scored again as a whole, as a group reward needs).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from mileage.rollout.journal import ToolJournal
from mileage.rollout.rewards import RewardFn, UserReward
from mileage.rollout.rewards.remote import RemoteReward

JOURNAL_NAME = "reward"
# how a journaled reward's scoring runs: in place, or once for all ranks (rank 0, broadcast)
ScoreOnce = Callable[[Callable[[], list[float]]], list[float]]


def in_place(work: Callable[[], list[float]]) -> list[float]:
    """Scoring where it is asked for: one process, or rank 0 alone driving the rollout."""
    return work()


def sample_digest(sample: Any) -> str:
    """What a reward was given for: the prompt, its label and the response, ids and text."""
    what = [
        sample.prompt.index,
        sample.prompt.text,
        sample.prompt.label,
        list(sample.response_ids),
        sample.response,
    ]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def reward_key(position: str) -> str:
    return f"{JOURNAL_NAME}/{position}"


def replay_or_score(
    journal: ToolJournal | None,
    slot: int | None,
    samples: Sequence[Any],
    positions: Sequence[str],
    score: Callable[[], list[float]],
) -> list[float]:
    """The rewards of `samples` (at `positions` of round `slot`) from the journal when all of
    them are recorded for these very samples; else `score()`, recorded before it is returned.
    Without a journal or a slot (evaluation) this is `score()`."""
    if journal is None or slot is None or not samples:
        return score()
    keys = [reward_key(p) for p in positions]
    digests = [sample_digest(s) for s in samples]
    entries = [journal.get(slot, key) for key in keys]
    if all(e is not None and e.get("sample") == d for e, d in zip(entries, digests, strict=True)):
        journal.replayed += len(entries)
        return [float(e["reward"]) for e in entries if e is not None]
    rewards = score()
    journal.record_batch(
        slot,
        [
            {"key": k, "sample": d, "reward": r}
            for k, d, r in zip(keys, digests, rewards, strict=True)
        ],
    )
    return rewards


def journaled(fn: RewardFn) -> bool:
    """Whether `fn` may answer differently when asked again: a reward server, an LLM judge, a
    user's function, a scorer that calls a model (it says so with `journaled = True`)."""
    return isinstance(fn, UserReward | RemoteReward) or bool(getattr(fn, "journaled", False))


def scored_once(
    fn: RewardFn,
    compute: Callable[[], list[float]],
    journal: ToolJournal | None,
    slot: int | None,
    samples: Sequence[Any],
    once: ScoreOnce = in_place,
) -> list[float]:
    """`compute()`, the rewards of `samples` by `fn`; journaled (`replay_or_score`, positions
    0..n-1 of round `slot`) and run by `once` (rank 0 for all ranks) when `fn` is `journaled`."""
    if not journaled(fn):
        return compute()
    positions = [str(i) for i in range(len(samples))]
    return once(lambda: replay_or_score(journal, slot, samples, positions, compute))
