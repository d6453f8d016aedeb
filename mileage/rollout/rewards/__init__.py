"""Rewards: miles' rule-based names, `remote_rm`, a reasoning-gym task's own scorer, or a user
function loaded from `--custom-rm-path`.

Every reward is `fn(prompt, response, label) -> float`. A custom one may be async; async ones
are awaited concurrently for a whole rollout, and `remote_rm` sends a rollout's requests
concurrently too. Which is used: `--custom-rm-path` if given, else `--rm-type`, else (the
default) the task's scorer for `gym:` prompt data and `exact` for anything else.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.rewards.remote import RemoteReward
from mileage.rollout.rewards.rules import BOXED, RULES, last_boxed

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
        None, "reward function as module.path:function, called as fn(prompt, response, label)"
    )
    rm_url: str | None = option(None, "reward server for remote_rm: POST {prompt, response, label}")
    rm_timeout: float = option(30.0, "remote_rm: seconds to wait for one answer")
    rm_retries: int = option(3, "remote_rm: retries of a failed request before the run stops")
    rm_max_concurrency: int = option(32, "remote_rm: requests in flight at once")


def load_custom_reward(path: str) -> RewardFn:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"--custom-rm-path must look like module.path:function, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise UserError(f"--custom-rm-path: cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"--custom-rm-path: {module_name!r} has no function {attr!r}")
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
        return load_custom_reward(cfg.custom_rm_path)
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
