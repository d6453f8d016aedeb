"""Verifiable rewards: `exact`, `math`, or a user function loaded from `--custom-rm-path`.

A custom reward is `fn(prompt, response, label) -> float`, sync or async; async ones are
awaited concurrently for a whole rollout.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from mileage.config import option
from mileage.errors import UserError

RewardFn = Callable[[str, str, str], float]


@dataclass
class RewardConfig:
    rm_type: str = option("exact", "built-in reward", choices=("exact", "math"))
    custom_rm_path: str | None = option(
        None, "reward function as module.path:function, called as fn(prompt, response, label)"
    )


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, honouring nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def parse_number(text: str) -> Fraction | None:
    """The final answer of `text` as an exact number: last \\boxed{} if any, else last number."""
    boxed = last_boxed(text)
    candidates = _NUMBER.findall(boxed if boxed is not None else text)
    if not candidates:
        return None
    try:
        return Fraction(candidates[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def exact_reward(prompt: str, response: str, label: str) -> float:
    return float(response.strip() == label.strip())


def math_reward(prompt: str, response: str, label: str) -> float:
    got, want = parse_number(response), parse_number(label)
    return float(got is not None and want is not None and got == want)


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


def build_reward_fn(cfg: RewardConfig) -> RewardFn:
    if cfg.custom_rm_path:
        return load_custom_reward(cfg.custom_rm_path)
    return {"exact": exact_reward, "math": math_reward}[cfg.rm_type]


def score_all(fn: RewardFn, items: list[tuple[str, str, str]]) -> list[float]:
    """Score (prompt, response, label) triples; async functions run concurrently."""
    if inspect.iscoroutinefunction(fn):

        async def gather() -> list[float]:
            return await asyncio.gather(*(fn(*item) for item in items))

        return [float(x) for x in asyncio.run(gather())]
    return [float(fn(*item)) for item in items]
