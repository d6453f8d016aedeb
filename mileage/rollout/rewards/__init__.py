"""Rewards: miles' rule-based names, `remote_rm`, a reasoning-gym task's own scorer, or a user
function loaded from `--custom-rm-path`.

Every built-in reward is `fn(prompt, response, label) -> float`. A custom one may also be a
function of the whole sample, `fn(config, sample)` (miles' `custom_rm(args, sample)`) or
`fn(sample)`, which sees the token ids, loss mask, tool calls and metadata of a multi-turn
trajectory; with `--group-rm` it is `fn(config, samples) -> list[float]` for one prompt's group.
The form is told by how many positional parameters the function takes (3, 2 or 1). A custom one
may be async; async ones are awaited concurrently for a whole rollout, and `remote_rm` sends a
rollout's requests concurrently too. Which is used: `--custom-rm-path` if given, else `--rm-type`, else (the
default) the task's scorer for `gym:` prompt data and `exact` for anything else.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.rewards.remote import RemoteReward
from mileage.rollout.rewards.rules import BOXED, RULES, last_boxed
from mileage.rollout.userfn import accepts, load_function, require_signature

RewardFn = Callable[[str, str, str], float]
RM_TYPES = (*RULES, *BOXED, "remote_rm", "boxed_remote_rm")


@dataclass
class RewardConfig:
    rm_type: str | None = option(
        None,
        "reward (miles' names; boxed_X grades only the last \\boxed{} with X). Default: the "
        "task's own scorer for gym: prompt data, else exact",
        choices=RM_TYPES,
    )
    custom_rm_path: str | None = option(
        None,
        "reward function (module.path:fn or path/to/file.py:fn), called as fn(prompt, response, "
        "label), fn(config, sample) (miles' custom_rm(args, sample)) or fn(sample), told apart "
        "by its parameters; may be async",
    )
    group_rm: bool = option(
        False,
        "score each prompt's group at once: --custom-rm-path is fn(config, samples) -> one "
        "reward per sample (miles' meaning)",
    )
    rm_url: str | None = option(None, "reward server for remote_rm: POST {prompt, response, label}")
    rm_timeout: float = option(30.0, "remote_rm: seconds to wait for one answer")
    rm_retries: int = option(3, "remote_rm: retries of a failed request before the run stops")
    rm_max_concurrency: int = option(32, "remote_rm: requests in flight at once")


def load_custom_reward(path: str, group_rm: bool = False) -> RewardFn:
    """The user's reward, checked against the forms it may take (module docstring)."""
    fn = load_function(path, "--custom-rm-path")
    if group_rm:
        require_signature(fn, "--custom-rm-path", 2, "fn(config, samples) -> list[float]")
    elif not any(accepts(fn, n) for n in (3, 2, 1)):
        raise UserError(
            f"--custom-rm-path: {getattr(fn, '__qualname__', fn)} must be callable as "
            "fn(prompt, response, label), fn(config, sample) or fn(sample)"
        )
    return fn


def remote_reward(cfg: RewardConfig, boxed: bool) -> RemoteReward:
    if not cfg.rm_url:
        raise UserError(f"--rm-type {cfg.rm_type} needs --rm-url (the reward server)")
    if cfg.rm_timeout <= 0 or cfg.rm_retries < 0 or cfg.rm_max_concurrency <= 0:
        raise UserError(
            "--rm-timeout and --rm-max-concurrency must be positive and --rm-retries >= 0"
        )
    transform = (lambda response: last_boxed(response) or "") if boxed else (lambda r: r)
    return RemoteReward(
        cfg.rm_url, cfg.rm_timeout, cfg.rm_retries, cfg.rm_max_concurrency, transform
    )


def build_reward_fn(cfg: RewardConfig, task_scorer: RewardFn | None = None) -> RewardFn:
    """The run's reward; `task_scorer` is the prompt data's own scorer, if it has one."""
    if cfg.custom_rm_path:
        return load_custom_reward(cfg.custom_rm_path, cfg.group_rm)
    if cfg.group_rm:
        raise UserError("--group-rm scores with a group function: give it with --custom-rm-path")
    if cfg.rm_type is None:
        return task_scorer or RULES["exact"]
    if cfg.rm_type in ("remote_rm", "boxed_remote_rm"):
        return remote_reward(cfg, boxed=cfg.rm_type.startswith("boxed_"))
    return {**RULES, **BOXED}[cfg.rm_type]


def score_all(fn: RewardFn, items: list[tuple[str, str, str]]) -> list[float]:
    """Score (prompt, response, label) triples; batch and async rewards run concurrently."""
    if hasattr(fn, "score_batch"):
        return [float(x) for x in fn.score_batch(items)]
    if inspect.iscoroutinefunction(fn):

        async def gather() -> list[float]:
            return await asyncio.gather(*(fn(*item) for item in items))

        return [float(x) for x in asyncio.run(gather())]
    return [float(fn(*item)) for item in items]


def _gather(calls: list) -> list:
    """Results of `calls` (values or awaitables), the awaitables awaited concurrently."""
    if not any(inspect.isawaitable(c) for c in calls):
        return calls

    async def gather() -> list:
        return await asyncio.gather(*(_awaited(c) for c in calls))

    return asyncio.run(gather())


async def _awaited(value):
    return await value if inspect.isawaitable(value) else value


def score_samples(
    fn: RewardFn, samples: list, config: object, group_size: int, group_rm: bool = False
) -> list[float]:
    """One reward per sample, by the reward's form (module docstring); samples of one prompt
    are `group_size` contiguous ones."""
    if group_rm:
        groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
        rewards = [float(r) for part in _gather([fn(config, g) for g in groups]) for r in part]
        if len(rewards) != len(samples):
            raise UserError(
                f"--group-rm: the reward function returned {len(rewards)} rewards for "
                f"{len(samples)} samples (one per sample of each group)"
            )
        return rewards
    if hasattr(fn, "score_batch") or accepts(fn, 3):
        return score_all(fn, [(s.prompt.text, s.response, s.prompt.label) for s in samples])
    if accepts(fn, 2):
        return [float(r) for r in _gather([fn(config, s) for s in samples])]
    return [float(r) for r in _gather([fn(s) for s in samples])]
