"""reasoning-gym tasks as prompt data, scored by each task's own `score_answer`.

A task is named where a prompt file would be: `--prompt-data 'gym:TASK?size=N&seed=S&KEY=VALUE'`.
`size` (default 1000) and `seed` (default 0) choose the items; `instruction` (optional) is
appended to every question, e.g. `instruction=Reply with only the number.`; every other key is
passed to the task's config (`min_digits=1`, `operators=+,-`; values are read as JSON when they parse, a comma
makes a list, anything else is a string). Item `i` of a reasoning-gym dataset is generated from
`Random(seed + i)`, so the same spec gives the same prompts in the same order on every machine,
and the data position `(epoch, offset)` of the checkpoint resumes exactly.

Without `--eval-prompt-data`, the held-out split is the same task and options with seed
`seed + EVAL_SEED_OFFSET` (far beyond any training index, so no item shares a training item's
random stream), without any question that also occurs in the training data: its first
`eval_size` items (default 100; a larger split starts with the smaller one's items).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from mileage.errors import UserError

PREFIX = "gym:"
DEFAULT_SIZE = 1000
DEFAULT_EVAL_SIZE = 100
EVAL_SEED_OFFSET = 1_000_000_000
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def is_gym_spec(text: str | None) -> bool:
    return bool(text) and text.startswith(PREFIX)


@dataclass(frozen=True)
class GymSpec:
    task: str
    size: int
    seed: int
    options: tuple[tuple[str, Any], ...] = ()
    instruction: str = ""
    eval_size: int = DEFAULT_EVAL_SIZE  # items of the held-out split (`eval_size=N`)

    def held_out(self) -> GymSpec:
        return replace(self, size=self.eval_size, seed=self.seed + EVAL_SEED_OFFSET)

    def prompt_text(self, entry: dict) -> str:
        return f"{entry['question']} {self.instruction}" if self.instruction else entry["question"]

    def __str__(self) -> str:
        extra = "".join(f"&{k}={json.dumps(v)}" for k, v in self.options)
        if self.eval_size != DEFAULT_EVAL_SIZE:
            extra += f"&eval_size={self.eval_size}"
        return f"{PREFIX}{self.task}?size={self.size}&seed={self.seed}{extra}"


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return [_value(part) for part in text.split(",")] if "," in text else text


def parse_gym_spec(text: str, flag: str = "--prompt-data") -> GymSpec:
    """`gym:TASK?size=N&seed=S&key=value` -> GymSpec; any malformed part is a UserError."""
    body = text[len(PREFIX) :]
    task, _, query = body.partition("?")
    if not task:
        raise UserError(f"{flag} {text!r}: name a reasoning-gym task, e.g. gym:basic_arithmetic")
    fields: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise UserError(f"{flag} {text!r}: {part!r} is not KEY=VALUE")
        value = _value(raw)
        # tuples, so that a spec is hashable (datasets are cached per spec)
        fields[key] = tuple(value) if isinstance(value, list) else value
    size, seed = fields.pop("size", DEFAULT_SIZE), fields.pop("seed", 0)
    eval_size = fields.pop("eval_size", DEFAULT_EVAL_SIZE)
    instruction = str(fields.pop("instruction", ""))
    for name, value in (("size", size), ("seed", seed), ("eval_size", eval_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"{flag} {text!r}: {name} must be a non-negative integer")
    if size == 0 or eval_size == 0:
        raise UserError(f"{flag} {text!r}: size and eval_size must be positive")
    options = tuple(sorted(fields.items()))
    return GymSpec(task, size, seed, options, instruction, eval_size)


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            "gym: prompt data needs reasoning-gym: pip install 'mileage[gym]'"
        ) from None
    return reasoning_gym


@lru_cache(maxsize=8)
def build_dataset(spec: GymSpec):
    """The reasoning-gym dataset of `spec` (cached: train, eval and scorer share one)."""
    rg = _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if spec.task not in DATASETS:
        raise UserError(
            f"unknown reasoning-gym task {spec.task!r}; known: {', '.join(sorted(DATASETS))}"
        )
    try:
        return rg.create_dataset(spec.task, size=spec.size, seed=spec.seed, **dict(spec.options))
    except (TypeError, ValueError, AssertionError) as exc:
        raise UserError(f"reasoning-gym task {spec.task!r} refused {spec}: {exc}") from None


@lru_cache(maxsize=8)
def gym_entries(spec: GymSpec, exclude: frozenset[str] = frozenset()) -> tuple[Any, list[dict]]:
    """The dataset and `spec.size` of its items in index order; questions in `exclude` are
    skipped and more items drawn (up to 20x the size) to make up the number."""
    if exclude:
        spec = replace(spec, size=spec.size * 20)
    dataset = build_dataset(spec)
    wanted = len(dataset) // 20 if exclude else len(dataset)
    entries = []
    for index in range(len(dataset)):
        entry = dataset[index]
        if entry["question"] not in exclude:
            entries.append(entry)
        if len(entries) == wanted:
            break
    if not entries:
        raise UserError(f"{spec} has no item whose question is not also a training question")
    return dataset, entries


def extract_answer(response: str) -> str:
    """reasoning-gym's convention: the last <answer>...</answer>, else the whole response."""
    tagged = _ANSWER_TAG.findall(response)
    return (tagged[-1] if tagged else response).strip()


class GymScorer:
    """Reward `fn(prompt, response, label)` that grades with the task's own `score_answer`."""

    def __init__(self):
        self._entries: dict[tuple[str, str], tuple[Any, dict]] = {}

    def add(self, spec: GymSpec, dataset: Any, entries: list[dict]) -> None:
        for entry in entries:
            self._entries[(spec.prompt_text(entry), str(entry["answer"]))] = (dataset, entry)

    def __call__(self, prompt: str, response: str, label: str) -> float:
        found = self._entries.get((prompt, label))
        if found is None:
            raise UserError(
                "the reasoning-gym scorer can only grade prompts of its gym: task; set --rm-type "
                "to grade other prompt data"
            )
        dataset, entry = found
        return float(dataset.score_answer(extract_answer(response), entry))
