"""DAPO's dynamic sampling for `mileage train`: draw prompts in rounds until a rollout has
`--rollout-batch-size` groups the filter keeps.

One rollout: first the groups left over by earlier rollouts (the `RolloutBuffer`, front first),
then sampling rounds of `--over-sampling-batch-size` prompts each. Every group of a round is
judged by the filter in submission order; kept groups fill the batch, and kept groups beyond it
go to the back of the buffer for the next rollout. The buffer is saved in the trainer state of
the same atomic commit as the data position, so every prompt the data source handed out is
either trained, dropped by the filter (and counted), or in the saved buffer.

Round k of the whole run samples with the seed of slot `buffer.next_slot`, a counter saved with
the buffer, so a resumed run samples exactly what the uninterrupted run sampled. The first slot
of a run is its start rollout id: with a filter that keeps everything and no over-sampling, a
run equals plain `mileage train` tensor for tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from mileage.config import option
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.buffer import Group, RolloutBuffer
from mileage.rollout.prompts import Prompt
from mileage.rollout.sample import Sample
from mileage.rollout.userfn import DEFAULT_HOOK_TIMEOUT, BoundedHook, Hook, load_function

MILES_NONZERO_STD = "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
MILEAGE_NONZERO_STD = "mileage.rollout.dynamic.check_reward_nonzero_std"

# fn(run_config, samples_of_one_group) -> bool, or an object with `.keep` (and `.reason`)
GroupFilter = Callable[[object, list[Sample]], object]
# miles' buffer filter: fn(args, rollout_id, buffer, num_groups) -> the groups taken, removed
# from `buffer` (a list of groups, each a list of samples) by the function itself
BufferFilter = Callable[[object, int, list[list[Sample]], int], list[list[Sample]]]


@dataclass
class DynamicSamplingConfig:
    dynamic_sampling_filter_path: str | None = option(
        None,
        "keep a prompt's group only if fn(config, samples) is true (module.path.fn or "
        f"module.path:fn); {MILES_NONZERO_STD} names the built-in 'rewards not all equal'",
    )
    over_sampling_batch_size: int | None = option(
        None,
        "prompts drawn per sampling round while a rollout has fewer than --rollout-batch-size "
        "kept groups (default: --rollout-batch-size)",
    )
    dynamic_sampling_max_rounds: int = option(
        10,
        "sampling rounds one rollout may take before the run stops (exit 2) with the counts",
    )
    buffer_filter_path: str | None = option(
        None,
        "which buffered groups a rollout takes first: fn(config, rollout_id, buffer, n) -> "
        "groups, removing them from buffer (miles' meaning; default: the first n)",
    )
    partial_rollout: bool = option(
        False,
        "generate in sampling rounds of --partial-rollout-round-tokens new tokens per sample; "
        "groups still unfinished when the rollout has its batch wait in the rollout buffer and "
        "continue from their partial answers in the next rollout (newer weights)",
    )
    partial_rollout_round_tokens: int | None = option(
        None,
        "with --partial-rollout: new tokens each unfinished sample generates per sampling round, "
        "the deterministic abort point (default: half of --rollout-max-response-len, rounded up)",
    )
    mask_offpolicy_in_partial_rollout: bool = option(
        False,
        "with --partial-rollout: train only on the tokens of the current weight version (tokens "
        "of older weights stay in the sequence but leave the loss and its denominator)",
    )

    @property
    def enabled(self) -> bool:
        return (
            self.dynamic_sampling_filter_path is not None
            or self.over_sampling_batch_size is not None
            or self.partial_rollout
        )

    def round_size(self, rollout_batch_size: int) -> int:
        return self.over_sampling_batch_size or rollout_batch_size

    def round_tokens(self, max_response_len: int) -> int:
        """--partial-rollout's token budget per sample and round."""
        return self.partial_rollout_round_tokens or -(-max_response_len // 2)

    def validate(self) -> None:
        if not self.partial_rollout:
            for name in ("mask_offpolicy_in_partial_rollout", "partial_rollout_round_tokens"):
                if getattr(self, name):
                    raise UserError(f"--{name.replace('_', '-')} needs --partial-rollout")
        if self.buffer_filter_path and not self.enabled:
            raise UserError(
                "--buffer-filter-path selects from dynamic sampling's buffer; give "
                "--dynamic-sampling-filter-path, --over-sampling-batch-size or --partial-rollout "
                "with it"
            )
        for name in (
            "over_sampling_batch_size",
            "dynamic_sampling_max_rounds",
            "partial_rollout_round_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")


def new_buffer(cfg: DynamicSamplingConfig, start_rollout_id: int) -> RolloutBuffer | None:
    """Dynamic sampling's buffer (None when off); its first slot (sampling seed) is the start
    rollout id, as plain training seeds it, until a checkpoint's buffer says otherwise."""
    if not cfg.enabled:
        return None
    buffer = RolloutBuffer()
    buffer.next_slot = start_rollout_id
    return buffer


def check_reward_nonzero_std(config: object, samples: list[Sample]) -> tuple[bool, str | None]:
    """Keep a group whose rewards are not all equal (its GRPO advantages are not all zero);
    a dropped group's reason is miles' `zero_std_<reward rounded to 1 digit>`."""
    rewards = [s.reward for s in samples]
    # the sample standard deviation is > 0 exactly when two rewards differ; comparing avoids
    # a float std that rounds to a tiny non-zero for equal rewards
    if any(r != rewards[0] for r in rewards):
        return True, None
    return False, f"zero_std_{round(rewards[0], 1)}"


def load_group_filter(path: str, timeout: float = DEFAULT_HOOK_TIMEOUT) -> GroupFilter:
    """The user's filter, behind the hook boundary (bounded by --hook-timeout, named when it
    fails; miles' built-in's path is a name for mileage's own equivalent: miles itself is not
    imported)."""
    if path in (MILES_NONZERO_STD, MILEAGE_NONZERO_STD):
        return check_reward_nonzero_std
    flag = "--dynamic-sampling-filter-path"
    return BoundedHook(load_function(path, flag), Hook("filter", flag, timeout))


def load_buffer_filter(path: str, timeout: float = DEFAULT_HOOK_TIMEOUT) -> BufferFilter:
    """The user's buffer filter, behind the hook boundary."""
    flag = "--buffer-filter-path"
    return BoundedHook(load_function(path, flag), Hook("buffer filter", flag, timeout))


def take_buffered(
    buffer: RolloutBuffer, fn: BufferFilter | None, config: object, rollout_id: int, count: int
) -> list[Group]:
    """Up to `count` buffered groups for this rollout: the oldest first, or those the user's
    buffer filter takes (what it leaves, in the order it leaves it, stays buffered)."""
    if fn is None:
        return [buffer.groups.popleft() for _ in range(min(count, len(buffer.groups)))]
    by_id = {id(g.samples): g for g in buffer.groups}
    listed = [g.samples for g in buffer.groups]
    taken = fn(config, rollout_id, listed, count)
    taken_ids = [id(samples) for samples in taken]
    left_ids = [id(samples) for samples in listed]
    known = set(by_id)
    if (
        len(taken) > count
        or not set(taken_ids) <= known
        or not set(left_ids) <= known
        or len(set(taken_ids + left_ids)) != len(taken_ids) + len(left_ids)
        or len(taken_ids) + len(left_ids) != len(by_id)
    ):
        raise UserError(
            f"--buffer-filter-path: rollout {rollout_id}: the filter must return at most {count} "
            "of the buffer's groups and remove exactly those from the buffer list"
        )
    buffer.groups.clear()
    buffer.groups.extend(by_id[i] for i in left_ids)
    return [by_id[i] for i in taken_ids]


def judge(fn: GroupFilter, config: object, samples: list[Sample]) -> tuple[bool, str]:
    """(keep, reason) from a filter returning a bool, (keep, reason) or miles' DynamicFilterOutput;
    anything else stops the run in one line (a "maybe" is not kept, nor a None)."""
    label = f"the group of prompt {samples[0].prompt.index}"
    out = fn.call(label, config, samples) if isinstance(fn, BoundedHook) else fn(config, samples)
    if isinstance(out, tuple) and len(out) == 2:
        keep, reason = out
    elif hasattr(out, "keep"):
        keep, reason = out.keep, getattr(out, "reason", None)
    else:
        keep, reason = out, None
    if _as_bool(keep) is None:
        raise UserError(
            f"--dynamic-sampling-filter-path: the filter returned {type(out).__name__} "
            f"{str(out)[:60]!r} for {label}; expected a bool, (bool, reason) or an object with "
            "a bool .keep"
        )
    keep = _as_bool(keep)
    return keep, "" if keep else (reason or "filtered")


def _as_bool(value: object) -> bool | None:
    """A bool, a numpy or torch one-element bool as one, else None."""
    if isinstance(value, bool):
        return value
    item = getattr(value, "item", None)
    if getattr(value, "dtype", None) is not None and callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError):  # more than one element
            return None
    return value if isinstance(value, bool) else None


@dataclass
class Sampled:
    """One rollout's groups (in the order they were accepted) and what it took to get them."""

    groups: list[Group]
    drawn: list[Prompt]  # every prompt the data source handed out for this rollout, in order
    stats: dict


def sample_dynamic(
    buffer: RolloutBuffer,
    draw: Callable[[int], list[Prompt]],
    generate: Callable[[list[Prompt], int], list[Sample]],
    keep: GroupFilter | None,
    config: object,
    buffer_filter: BufferFilter | None,
    cfg: DynamicSamplingConfig,
    batch_size: int,
    n_samples: int,
    rollout_id: int,
) -> Sampled:
    """Fill one rollout: buffered groups first, then rounds of `draw(size)` prompts sampled by
    `generate(prompts, slot)`; raises UserError (exit 2) when the round cap is reached."""
    groups = take_buffered(buffer, buffer_filter, config, rollout_id, batch_size)
    from_buffer = len(groups)
    drawn: list[Prompt] = []
    dropped: Counter[str] = Counter()
    rounds = 0
    while len(groups) < batch_size:
        if rounds == cfg.dynamic_sampling_max_rounds:
            raise round_cap_error(rollout_id, len(groups), batch_size, rounds, len(drawn), dropped)
        prompts = draw(cfg.round_size(batch_size))
        slot = buffer.next_slot
        buffer.next_slot += 1
        samples = generate(prompts, slot)
        rounds += 1
        drawn += prompts
        for start in range(0, len(samples), n_samples):
            group = Group(slot, rollout_id, samples[start : start + n_samples])
            kept, reason = (True, "") if keep is None else judge(keep, config, group.samples)
            if not kept:
                dropped[reason] += 1
            elif len(groups) < batch_size:
                groups.append(group)
            else:  # accepted in submission order: what the batch has no room for waits
                buffer.groups.append(group)
        fault_point("after_sampling_round")
    kept = len(drawn) - sum(dropped.values())
    stats = round_stats(rounds, drawn, from_buffer, kept, dropped, buffer, groups)
    return Sampled(groups, drawn, stats)


def round_cap_error(
    rollout_id: int, kept: int, batch_size: int, rounds: int, drawn: int, dropped: Counter[str]
) -> UserError:
    """The one line a run stops with when a rollout's rounds never fill its batch."""
    reasons = ", ".join(f"{r} {c}" for r, c in sorted(dropped.items()))
    return UserError(
        f"rollout {rollout_id}: dynamic sampling kept {kept} of {batch_size} "
        f"groups after {rounds} rounds ({drawn} prompts drawn, "
        f"{sum(dropped.values())} groups dropped: {reasons or 'none'}); raise "
        "--dynamic-sampling-max-rounds or --over-sampling-batch-size, or filter less"
    )


def round_stats(
    rounds: int,
    drawn: list[Prompt],
    from_buffer: int,
    kept: int,
    dropped: Counter[str],
    buffer: RolloutBuffer,
    groups: list[Group],
) -> dict:
    """A rollout's dynamic_filter/* metrics, the prompts it drew and its groups' slots."""
    return {
        "dynamic_filter/rounds": rounds,
        "dynamic_filter/groups_drawn": len(drawn),
        "dynamic_filter/groups_from_buffer": from_buffer,
        "dynamic_filter/groups_kept": kept,
        "dynamic_filter/groups_dropped": sum(dropped.values()),
        "dynamic_filter/groups_buffered": len(buffer.groups),
        **{f"dynamic_filter/drop_{r}": c for r, c in sorted(dropped.items())},
        "drawn_prompt_indices": [p.index for p in drawn],
        # the sampling round (slot) each trained group came from, beside "prompt_indices"
        "group_slots": [g.slot for g in groups],
    }
