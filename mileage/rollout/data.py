"""Prompt data: JSONL, Parquet, reasoning-gym tasks, verifiers tasksets or built-in records, and a data source
whose position is checkpointed.

The order of epoch `e` is a pure function of `(seed, e)` when `--rollout-shuffle` is on and the
file order otherwise, so the position `(epoch, offset)` is all a checkpoint needs to continue at
the exact next prompt, across epoch boundaries included.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout import gym, tool_task, vfenv
from mileage.rollout.prompts import KEY_FLAGS, Prompt, load_jsonl, load_parquet
from mileage.rollout.tasks import TASKS, builtin_task
from mileage.seeding import generator_for


@dataclass
class DataConfig:
    prompt_data: str | None = option(
        None,
        "prompts: a .jsonl or .parquet file, or a reasoning-gym task as "
        "'gym:TASK?size=N&seed=S&OPTION=VALUE', or a verifiers taskset as "
        "'verifiers:ID?limit=N&skip=M&OPTION=VALUE' (default: the built-in task)",
    )
    input_key: str = option("prompt", "JSONL key / Parquet column holding the prompt")
    label_key: str = option("label", "JSONL key / Parquet column holding the reference answer")
    apply_chat_template: bool = option(False, "wrap each prompt in the tokenizer's chat template")
    rollout_shuffle: bool = option(
        False, "shuffle prompts each epoch (order derived from seed, epoch)"
    )
    builtin_task: str = option(
        "addition", "built-in task when --prompt-data is unset", choices=TASKS
    )
    eval_prompt_data: list[str] | None = option(
        None,
        "evaluation datasets as NAME PATH pairs, each PATH in any --prompt-data form; one PATH "
        "alone is named after its file or gym task (default: the held-out split of the built-in "
        "task or of a gym: task; none for a file)",
        nargs="+",
    )
    eval_input_key: str | None = option(None, "--input-key of the evaluation data (default: it)")
    eval_label_key: str | None = option(None, "--label-key of the evaluation data (default: it)")
    eval_tool_key: str | None = option(
        None, "--tool-key of the evaluation data (default: it); its tools go to the tool loop"
    )
    tool_key: str = option(
        "tools",
        "JSONL key holding a record's tool specs (a list of OpenAI-style tool dicts), passed to "
        "the chat template as tools= (miles' meaning); absent keys mean no tools",
    )
    metadata_key: str = option(
        "metadata", "JSONL key holding a record's metadata dict (Sample.metadata; miles' meaning)"
    )


@dataclass(frozen=True)
class EvalSet:
    """One named evaluation dataset; its metrics are logged as `eval/NAME/...`."""

    name: str
    prompts: list[Prompt]


def _from_records(records: list[dict[str, str]]) -> list[Prompt]:
    return [Prompt(i, r["prompt"], r["label"]) for i, r in enumerate(records)]


def _gym_prompts(spec: gym.GymSpec, entries: list[dict]) -> list[Prompt]:
    return [Prompt(i, spec.prompt_text(e), str(e["answer"])) for i, e in enumerate(entries)]


def _vf_prompts(spec: vfenv.VerifiersSpec, chat: bool, flag: str = "--prompt-data") -> list[Prompt]:
    """The tasks' prompts: message lists for the chat template when `chat`, else folded text.
    The label is the task's key: the scorer finds the task (data, rubric) by it."""
    tasks = vfenv.load_tasks(spec, flag)
    if not chat:
        return [Prompt(i, vfenv.prompt_text(t), t.key) for i, t in enumerate(tasks)]
    prompts = []
    for i, task in enumerate(tasks):
        messages = vfenv.prompt_messages(task)
        prompts.append(Prompt(i, messages[-1]["content"], task.key, messages))
    return prompts


def _vf_evals(cfg: DataConfig) -> list[tuple[str, vfenv.VerifiersSpec]]:
    """(name, spec) of each --eval-prompt-data dataset that is a verifiers taskset."""
    return [
        (name, vfenv.parse_verifiers_spec(source, "--eval-prompt-data"))
        for name, source in eval_sources(cfg)
        if vfenv.is_verifiers_spec(source)
    ]


def _gym_train(cfg: DataConfig) -> tuple[gym.GymSpec, Any, list[dict]]:
    spec = gym.parse_gym_spec(cfg.prompt_data)
    return (spec, *gym.gym_entries(spec))


def eval_sources(cfg: DataConfig) -> list[tuple[str, str]]:
    """(name, source) of each --eval-prompt-data dataset, in the order given.

    miles' pairs; a single value is one dataset named after its file (`aime-2024.jsonl` ->
    `aime-2024`) or its gym task, so `--eval-prompt-data test.jsonl` keeps working.
    """
    values = list(cfg.eval_prompt_data or [])
    if len(values) == 1:
        source = values[0]
        if gym.is_gym_spec(source):
            name = gym.parse_gym_spec(source, "--eval-prompt-data").task
        elif vfenv.is_verifiers_spec(source):
            name = vfenv.parse_verifiers_spec(source, "--eval-prompt-data").name
        else:
            name = Path(source).stem
        return [(name, source)]
    if len(values) % 2:
        raise UserError(f"--eval-prompt-data takes NAME PATH pairs; {values[-1]!r} has no path")
    pairs = [(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    seen: set[str] = set()
    for name, _ in pairs:
        if not name or "/" in name or name != name.strip():
            raise UserError(
                f"--eval-prompt-data: dataset name {name!r} must be non-empty, without '/' or "
                "surrounding spaces (it becomes the metric key eval/NAME/...)"
            )
        if name in seen:
            raise UserError(f"--eval-prompt-data: dataset name {name!r} is given twice")
        seen.add(name)
    return pairs


def _gym_evals(cfg: DataConfig) -> list[tuple[str, tuple[gym.GymSpec, Any, list[dict]]]]:
    """(name, (gym spec, dataset, items)) of each evaluation dataset that is a gym task: the
    --eval-prompt-data ones, or the training task's held-out split when none is given."""
    if cfg.eval_prompt_data:
        parts = []
        for name, source in eval_sources(cfg):
            if gym.is_gym_spec(source):
                spec = gym.parse_gym_spec(source, "--eval-prompt-data")
                parts.append((name, (spec, *gym.gym_entries(spec))))
        return parts
    if not gym.is_gym_spec(cfg.prompt_data):
        return []
    train_questions = frozenset(e["question"] for e in _gym_train(cfg)[2])
    spec = gym.parse_gym_spec(cfg.prompt_data).held_out()
    return [(spec.task, (spec, *gym.gym_entries(spec, train_questions)))]


def load_prompts(
    source: str,
    input_key: str,
    label_key: str,
    key_flags: str = KEY_FLAGS,
    tool_key: str | None = None,
    metadata_key: str | None = None,
) -> list[Prompt]:
    """Prompts from a JSONL or Parquet file (by suffix); gym: specs go through `gym`. Tools
    and metadata (and message-list prompts) are read from JSONL."""
    if source.endswith(".parquet"):
        return load_parquet(source, input_key, label_key, key_flags)
    return load_jsonl(source, input_key, label_key, key_flags, tool_key, metadata_key)


def load_train_prompts(cfg: DataConfig) -> list[Prompt]:
    if gym.is_gym_spec(cfg.prompt_data):
        spec, _, entries = _gym_train(cfg)
        return _gym_prompts(spec, entries)
    if vfenv.is_verifiers_spec(cfg.prompt_data):
        return _vf_prompts(vfenv.parse_verifiers_spec(cfg.prompt_data), cfg.apply_chat_template)
    if cfg.prompt_data:
        return load_prompts(
            cfg.prompt_data, cfg.input_key, cfg.label_key, KEY_FLAGS, cfg.tool_key, cfg.metadata_key
        )
    return _from_records(builtin_task(cfg.builtin_task)[0])


def load_eval_sets(cfg: DataConfig) -> list[EvalSet]:
    """The evaluation datasets, in --eval-prompt-data order ([] when there are none)."""
    gyms = dict(_gym_evals(cfg))
    vfs = dict(_vf_evals(cfg)) if cfg.eval_prompt_data else {}
    if cfg.eval_prompt_data:
        input_key = cfg.eval_input_key or cfg.input_key
        label_key = cfg.eval_label_key or cfg.label_key
        return [
            EvalSet(
                name,
                _gym_prompts(gyms[name][0], gyms[name][2])
                if name in gyms
                else _vf_prompts(vfs[name], cfg.apply_chat_template, "--eval-prompt-data")
                if name in vfs
                else load_prompts(
                    source,
                    input_key,
                    label_key,
                    "--eval-input-key/--eval-label-key",
                    cfg.eval_tool_key or cfg.tool_key,
                    cfg.metadata_key,
                ),
            )
            for name, source in eval_sources(cfg)
        ]
    if gyms:
        ((name, (spec, _, entries)),) = gyms.items()
        return [EvalSet(name, _gym_prompts(spec, entries))]
    if cfg.prompt_data:
        return []
    return [EvalSet(cfg.builtin_task, _from_records(builtin_task(cfg.builtin_task)[1]))]


def task_reward(cfg: DataConfig) -> Callable[[str, str, str], float] | None:
    """The task's own scorer when the prompts come from reasoning-gym, verifiers, or a built-in
    task with one (`addition-tool`: the answer after the tool's result), else None."""
    vf_train = vfenv.is_verifiers_spec(cfg.prompt_data)
    vf_evals = _vf_evals(cfg) if cfg.eval_prompt_data else []
    if vf_train or vf_evals:
        if gym.is_gym_spec(cfg.prompt_data) or _gym_evals(cfg):
            raise UserError(
                "gym: and verifiers: prompt data each bring their own scorer; use one of them "
                "per run"
            )
        scorer = vfenv.VerifiersScorer()
        if vf_train:
            scorer.add(vfenv.load_tasks(vfenv.parse_verifiers_spec(cfg.prompt_data)))
        for _, spec in vf_evals:
            scorer.add(vfenv.load_tasks(spec, "--eval-prompt-data"))
        return scorer
    gym_evals = _gym_evals(cfg)
    if not cfg.prompt_data and not gym_evals and cfg.builtin_task == tool_task.TASK:
        return tool_task.tool_task_reward
    if not gym.is_gym_spec(cfg.prompt_data) and not gym_evals:
        return None
    scorer = gym.GymScorer()
    if gym.is_gym_spec(cfg.prompt_data):
        scorer.add(*_gym_train(cfg))
    for _, part in gym_evals:
        scorer.add(*part)
    return scorer


def data_digest(prompts: list[Prompt]) -> str:
    """sha256 over every prompt and label: a resume on other data with the same size is refused."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([p.text, p.label]).encode())
    return digest.hexdigest()


class PromptSource:
    """Hands out prompt batches in a reproducible order; `state_dict` is its exact position."""

    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int):
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []
        self.digest = data_digest(prompts)

    def order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` visits them."""
        if self._order_epoch != epoch:
            if self.shuffle:
                gen = generator_for(self.seed, "shuffle", epoch)
                self._order = torch.randperm(len(self.prompts), generator=gen).tolist()
            else:
                self._order = list(range(len(self.prompts)))
            self._order_epoch = epoch
        return self._order

    def next_batch(self, size: int) -> list[Prompt]:
        batch = []
        while len(batch) < size:
            order = self.order(self.epoch)
            take = min(size - len(batch), len(order) - self.offset)
            batch += [self.prompts[i] for i in order[self.offset : self.offset + take]]
            self.offset += take
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "size": len(self.prompts),
            "shuffle": self.shuffle,
            "digest": self.digest,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.prompts):
            raise UserError(
                f"the checkpoint's data position is for {state['size']} prompts but the data now has "
                f"{len(self.prompts)}; resume with the same --prompt-data or use --finetune"
            )
        # checkpoints from before the digest was recorded carry none; size is all they can check
        if state.get("digest", self.digest) != self.digest:
            raise UserError(
                "the checkpoint's data position is for other prompts than --prompt-data gives now "
                "(same count, different content); resume with the same data or use --finetune"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
