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

Every reward, whatever its source, is checked where it is scored (`checked_reward`): a finite
real number with |r| <= MAX_ABS_REWARD (a bool counts as 0 or 1, as `response == label` is a
common reward); anything else stops the run in one line naming the sample. A custom function
runs behind the hook boundary (`mileage.rollout.userfn`): bounded by --hook-timeout, and one
that raises or calls sys.exit is named with its flag.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mileage.config import flag_of, option
from mileage.errors import UserError
from mileage.rollout.rewards.judge import JudgeReward, load_template
from mileage.rollout.rewards.remote import RemoteReward
from mileage.rollout.rewards.rules import BOXED, RULES, last_boxed
from mileage.rollout.userfn import (
    DEFAULT_HOOK_TIMEOUT,
    Hook,
    HookCalls,
    accepts,
    load_function,
    require_signature,
    run_hook,
)

RewardFn = Callable[[str, str, str], float]
RM_TYPES = (*RULES, *BOXED, "remote_rm", "boxed_remote_rm", "llm_judge")
# the largest |reward| the run trains on. Group normalisation sums rewards and their squares: at
# 1e308 the sum overflows to inf and every advantage of the group is nan (a reward of 1e308 got
# that far); 1e6 keeps squares and sums of any group exact enough in float64 and finite in the
# fp32 of the loss, and is far above any reward scale in use (rule rewards are 0/1, reward
# models a few units).
MAX_ABS_REWARD = 1e6
CUSTOM_RM = "--custom-rm-path"


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
    rm_url: str | None = option(
        None,
        "reward server for remote_rm (POST {prompt, response, label}); for llm_judge the judge's "
        "OpenAI base URL (e.g. http://127.0.0.1:8000/v1)",
    )
    rm_timeout: float = option(30.0, "remote_rm, llm_judge: seconds to wait for one answer")
    rm_retries: int = option(
        3,
        "remote_rm, llm_judge: retries of a failed request or unreadable reply before the run stops",
    )
    rm_max_concurrency: int = option(32, "remote_rm, llm_judge: requests in flight at once")
    judge_prompt_path: str | None = option(
        None,
        "llm_judge: the prompt template file; {prompt}, {response}, {label} and {max_score} are "
        "filled in. Default: a 0..max grading prompt asking for 'Score: N' (docs/judges.md)",
    )
    judge_model: str | None = option(
        None, "llm_judge: the model name sent to the judge server (default: the first it lists)"
    )
    judge_max_score: float = option(
        10.0, "llm_judge: the top of the judge's scale; the reward is score / this, in [0, 1]"
    )
    judge_max_tokens: int = option(512, "llm_judge: the judge's reply cap, in tokens")
    judge_temperature: float = option(0.0, "llm_judge: the judge's sampling temperature")

    def validate(self) -> None:
        """Judge flags belong to --rm-type llm_judge: given without it they would do nothing."""
        judge = [f for f in dataclasses.fields(self) if f.name.startswith("judge_")]
        given = [flag_of(RewardConfig, f.name) for f in judge if getattr(self, f.name) != f.default]
        if given and self.rm_type != "llm_judge":
            raise UserError(
                f"{', '.join(given)} configure the LLM judge; add --rm-type llm_judge --rm-url "
                "URL or drop them"
            )


def checked_reward(value: Any, source: str, label: str) -> float:
    """`value` as the reward of `label` ("sample 3 (prompt 7)"), or the run stopped in one line
    naming `source` (the function and its flag), the sample and what a reward must be."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real) and _one_element(value):
        value = value.item()  # a one-element tensor or array
    if not isinstance(value, numbers.Real):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise UserError(
            f"{source} returned {type(value).__name__} {shown} for {label}; expected a finite "
            "real number (a bool counts as 0 or 1)"
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise UserError(f"{source} returned {reward} for {label}; expected a finite real number")
    if abs(reward) > MAX_ABS_REWARD:
        raise UserError(
            f"{source} returned {reward:g} for {label}; expected |reward| <= {MAX_ABS_REWARD:g} "
            "(larger ones overflow the advantage math: rewards.MAX_ABS_REWARD)"
        )
    return reward


def _one_element(value: Any) -> bool:
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        count = numel() if callable(numel) else numel
    except TypeError:
        return False
    return count == 1 and callable(getattr(value, "item", None))


class UserReward:
    """--custom-rm-path behind the hook boundary: its calls bounded, named when they fail."""

    def __init__(self, fn: Callable, group_rm: bool, timeout: float = DEFAULT_HOOK_TIMEOUT):
        self.fn = fn
        self.group_rm = group_rm
        self.hook = Hook("reward function", CUSTOM_RM, timeout)
        self.source = f"{CUSTOM_RM}: the reward function {getattr(fn, '__qualname__', fn)}"

    def __call__(self, *args: Any) -> Any:
        """One call (fn(prompt, response, label) or its other forms), unchecked."""
        return run_hook(self.hook, "one call", self.fn, *args)

    def call_all(self, args: Sequence[tuple], labels: list[str]) -> list[Any]:
        """fn(*a) for each `a`, in one worker thread; async ones awaited concurrently."""
        fn = self.fn

        def body(calls: HookCalls) -> list[Any]:
            if inspect.iscoroutinefunction(fn):
                return asyncio.run(_all(calls, [fn(*a) for a in args]))
            results = [calls.call(i, fn, *a) for i, a in enumerate(args)]
            if any(inspect.isawaitable(r) for r in results):
                return asyncio.run(_all(calls, results))
            return results

        return HookCalls(self.hook, labels).run(body)


async def _all(calls: HookCalls, values: list) -> list:
    """The values, the awaitables among them awaited concurrently (each as its own call)."""

    async def one(index: int, value: Any) -> Any:
        return await calls.acall(index, value) if inspect.isawaitable(value) else value

    return await asyncio.gather(*(one(i, v) for i, v in enumerate(values)))


def load_custom_reward(
    path: str, group_rm: bool = False, timeout: float = DEFAULT_HOOK_TIMEOUT
) -> UserReward:
    """The user's reward, checked against the forms it may take (module docstring)."""
    fn = load_function(path, CUSTOM_RM)
    if group_rm:
        require_signature(fn, CUSTOM_RM, 2, "fn(config, samples) -> list[float]")
    elif not any(accepts(fn, n) for n in (3, 2, 1)):
        raise UserError(
            f"{CUSTOM_RM}: {getattr(fn, '__qualname__', fn)} must be callable as "
            "fn(prompt, response, label), fn(config, sample) or fn(sample)"
        )
    return UserReward(fn, group_rm, timeout)


def _check_server_flags(cfg: RewardConfig, what: str) -> None:
    if not cfg.rm_url:
        raise UserError(f"--rm-type {cfg.rm_type} needs --rm-url ({what})")
    if cfg.rm_timeout <= 0 or cfg.rm_retries < 0 or cfg.rm_max_concurrency <= 0:
        raise UserError(
            "--rm-timeout and --rm-max-concurrency must be positive and --rm-retries >= 0"
        )


def remote_reward(cfg: RewardConfig, boxed: bool) -> RemoteReward:
    _check_server_flags(cfg, "the reward server")
    transform = (lambda response: last_boxed(response) or "") if boxed else (lambda r: r)
    return RemoteReward(
        cfg.rm_url, cfg.rm_timeout, cfg.rm_retries, cfg.rm_max_concurrency, transform
    )


def llm_judge(cfg: RewardConfig) -> JudgeReward:
    _check_server_flags(cfg, "the judge's OpenAI base URL")
    if not (cfg.judge_max_score > 0 and cfg.judge_max_tokens > 0 and cfg.judge_temperature >= 0):
        raise UserError(
            "--judge-max-score and --judge-max-tokens must be positive, --judge-temperature >= 0"
        )
    return JudgeReward(
        cfg.rm_url,
        cfg.judge_model,
        load_template(cfg.judge_prompt_path),
        cfg.judge_max_score,
        cfg.judge_max_tokens,
        cfg.judge_temperature,
        cfg.rm_timeout,
        cfg.rm_retries,
        cfg.rm_max_concurrency,
    )


def build_reward_fn(
    cfg: RewardConfig,
    task_scorer: RewardFn | None = None,
    timeout: float = DEFAULT_HOOK_TIMEOUT,
) -> RewardFn:
    """The run's reward; `task_scorer` is the prompt data's own scorer, if it has one;
    `timeout` bounds each call of a custom one (--hook-timeout)."""
    if cfg.custom_rm_path:
        return load_custom_reward(cfg.custom_rm_path, cfg.group_rm, timeout)
    if cfg.group_rm:
        raise UserError("--group-rm scores with a group function: give it with --custom-rm-path")
    if cfg.rm_type is None:
        return task_scorer or RULES["exact"]
    if cfg.rm_type in ("remote_rm", "boxed_remote_rm"):
        return remote_reward(cfg, boxed=cfg.rm_type.startswith("boxed_"))
    if cfg.rm_type == "llm_judge":
        return llm_judge(cfg)
    return {**RULES, **BOXED}[cfg.rm_type]


def _source(fn: RewardFn) -> str:
    """How a failing reward is named."""
    if isinstance(fn, UserReward):
        return fn.source
    if isinstance(fn, JudgeReward):
        return "--rm-type llm_judge: the judge"
    if isinstance(fn, RemoteReward):
        return "--rm-type remote_rm: the reward server"
    return f"the reward {getattr(fn, '__qualname__', type(fn).__name__)}"


def _checked_all(fn: RewardFn, values: list, labels: list[str]) -> list[float]:
    if len(values) != len(labels):
        raise UserError(f"{_source(fn)} returned {len(values)} rewards for {len(labels)} samples")
    source = _source(fn)
    return [checked_reward(v, source, label) for v, label in zip(values, labels, strict=True)]


def score_all(fn: RewardFn, items: list[tuple[str, str, str]]) -> list[float]:
    """Score (prompt, response, label) triples; batch and async rewards run concurrently."""
    return _score_triples(fn, items, [f"sample {i}" for i in range(len(items))])


def _score_triples(fn: RewardFn, items: list[tuple[str, str, str]], labels: list[str]) -> list:
    if isinstance(fn, UserReward):
        return _checked_all(fn, fn.call_all(items, labels), labels)
    if hasattr(fn, "score_batch"):
        return _checked_all(fn, list(fn.score_batch(items)), labels)
    if inspect.iscoroutinefunction(fn):

        async def gather() -> list[float]:
            return await asyncio.gather(*(fn(*item) for item in items))

        return _checked_all(fn, list(asyncio.run(gather())), labels)
    return _checked_all(fn, [fn(*item) for item in items], labels)


def score_samples(
    fn: RewardFn, samples: list, config: object, group_size: int, group_rm: bool = False
) -> list[float]:
    """One reward per sample, by the reward's form (module docstring); samples of one prompt
    are `group_size` contiguous ones."""
    labels = [f"sample {i} (prompt {s.prompt.index})" for i, s in enumerate(samples)]
    if not isinstance(fn, UserReward):  # built-in rewards take (prompt, response, label)
        triples = [(s.prompt.text, s.response, s.prompt.label) for s in samples]
        return _score_triples(fn, triples, labels)
    if group_rm:
        starts = range(0, len(samples), group_size)
        groups = [samples[i : i + group_size] for i in starts]
        names = [f"the group of prompt {g[0].prompt.index}" for g in groups]
        per_group = fn.call_all([(config, g) for g in groups], names)
        rewards = []
        for name, group, part in zip(names, groups, per_group, strict=True):
            if not isinstance(part, list | tuple) or len(part) != len(group):
                got = len(part) if isinstance(part, list | tuple) else type(part).__name__
                raise UserError(
                    f"--group-rm: {fn.source} returned {got} for {name}; expected a list of "
                    f"{len(group)} rewards (one per sample of the group)"
                )
            rewards += list(part)
        return _checked_all(fn, rewards, labels)
    if accepts(fn.fn, 3):
        triples = [(s.prompt.text, s.response, s.prompt.label) for s in samples]
        return _score_triples(fn, triples, labels)
    args = [(config, s) for s in samples] if accepts(fn.fn, 2) else [(s,) for s in samples]
    return _checked_all(fn, fn.call_all(args, labels), labels)
