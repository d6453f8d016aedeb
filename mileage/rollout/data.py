"""Prompt data: JSONL, Parquet, reasoning-gym tasks or built-in records, and a data source
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
from mileage.rollout import gym
from mileage.rollout.tasks import TASKS, builtin_task
from mileage.seeding import generator_for


@dataclass
class DataConfig:
    prompt_data: str | None = option(
        None,
        "prompts: a .jsonl or .parquet file, or a reasoning-gym task as "
        "'gym:TASK?size=N&seed=S&OPTION=VALUE' (default: the built-in task)",
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
    eval_prompt_data: str | None = option(
        None,
        "evaluation prompts, in any --prompt-data form (default: the held-out split of the "
        "built-in task or of a gym: task; none for a file)",
    )


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the dataset; stable across runs
    text: str
    label: str


def load_jsonl(path: str, input_key: str, label_key: str) -> list[Prompt]:
    """Read prompts from JSONL, naming the file and line of the first bad record."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompt file not found: {path}")
    prompts = []
    with file.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            for key in (input_key, label_key):
                if not isinstance(record, dict) or key not in record:
                    raise UserError(
                        f"{path}:{lineno}: missing key {key!r} (set --input-key/--label-key)"
                    )
            prompts.append(Prompt(len(prompts), str(record[input_key]), str(record[label_key])))
    if not prompts:
        raise UserError(f"prompt file is empty: {path}")
    return prompts


def load_parquet(path: str, input_key: str, label_key: str) -> list[Prompt]:
    """Read prompts from the `input_key` and `label_key` columns of a Parquet file."""
    if not Path(path).is_file():
        raise UserError(f"prompt file not found: {path}")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install 'mileage[parquet]'") from None
    try:
        columns = pq.read_schema(path).names
        missing = [key for key in (input_key, label_key) if key not in columns]
        if missing:
            raise UserError(
                f"{path}: missing column {missing[0]!r} (set --input-key/--label-key); "
                f"columns: {', '.join(columns)}"
            )
        table = pq.read_table(path, columns=[input_key, label_key]).to_pydict()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise UserError(f"{path}: not a readable Parquet file ({exc})") from None
    prompts = [
        Prompt(i, str(text), str(label))
        for i, (text, label) in enumerate(zip(table[input_key], table[label_key], strict=True))
    ]
    if not prompts:
        raise UserError(f"prompt file is empty: {path}")
    return prompts


def _from_records(records: list[dict[str, str]]) -> list[Prompt]:
    return [Prompt(i, r["prompt"], r["label"]) for i, r in enumerate(records)]


def _gym_prompts(spec: gym.GymSpec, entries: list[dict]) -> list[Prompt]:
    return [Prompt(i, spec.prompt_text(e), str(e["answer"])) for i, e in enumerate(entries)]


def _gym_train(cfg: DataConfig) -> tuple[gym.GymSpec, Any, list[dict]]:
    spec = gym.parse_gym_spec(cfg.prompt_data)
    return (spec, *gym.gym_entries(spec))


def _gym_eval(cfg: DataConfig) -> tuple[gym.GymSpec, Any, list[dict]] | None:
    """The gym spec, dataset and items for evaluation, or None when it is not on a gym task."""
    if gym.is_gym_spec(cfg.eval_prompt_data):
        spec = gym.parse_gym_spec(cfg.eval_prompt_data, "--eval-prompt-data")
        return (spec, *gym.gym_entries(spec))
    if cfg.eval_prompt_data or not gym.is_gym_spec(cfg.prompt_data):
        return None
    train_questions = frozenset(e["question"] for e in _gym_train(cfg)[2])
    spec = gym.parse_gym_spec(cfg.prompt_data).held_out()
    return (spec, *gym.gym_entries(spec, train_questions))


def load_prompts(source: str, input_key: str, label_key: str) -> list[Prompt]:
    """Prompts from a JSONL or Parquet file (by suffix); gym: specs go through `gym`."""
    if source.endswith(".parquet"):
        return load_parquet(source, input_key, label_key)
    return load_jsonl(source, input_key, label_key)


def load_train_prompts(cfg: DataConfig) -> list[Prompt]:
    if gym.is_gym_spec(cfg.prompt_data):
        spec, _, entries = _gym_train(cfg)
        return _gym_prompts(spec, entries)
    if cfg.prompt_data:
        return load_prompts(cfg.prompt_data, cfg.input_key, cfg.label_key)
    return _from_records(builtin_task(cfg.builtin_task)[0])


def load_eval_prompts(cfg: DataConfig) -> list[Prompt] | None:
    held_out = _gym_eval(cfg)
    if held_out is not None:
        return _gym_prompts(held_out[0], held_out[2])
    if cfg.eval_prompt_data:
        return load_prompts(cfg.eval_prompt_data, cfg.input_key, cfg.label_key)
    if cfg.prompt_data:
        return None
    return _from_records(builtin_task(cfg.builtin_task)[1])


def task_reward(cfg: DataConfig) -> Callable[[str, str, str], float] | None:
    """The task's own scorer when the prompts come from reasoning-gym, else None."""
    if not gym.is_gym_spec(cfg.prompt_data) and not gym.is_gym_spec(cfg.eval_prompt_data):
        return None
    scorer = gym.GymScorer()
    for part in (_gym_train(cfg) if gym.is_gym_spec(cfg.prompt_data) else None, _gym_eval(cfg)):
        if part is not None:
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
