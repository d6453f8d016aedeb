"""Prompt data: JSONL or built-in records, and a data source whose position is checkpointed.

The order of epoch `e` is a pure function of `(seed, e)` when `--rollout-shuffle` is on and the
file order otherwise, so the position `(epoch, offset)` is all a checkpoint needs to continue at
the exact next prompt, across epoch boundaries included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.tasks import TASKS, builtin_task
from mileage.seeding import generator_for


@dataclass
class DataConfig:
    prompt_data: str | None = option(None, "JSONL file of prompts (default: the built-in task)")
    input_key: str = option("prompt", "JSONL key holding the prompt")
    label_key: str = option("label", "JSONL key holding the reference answer")
    apply_chat_template: bool = option(False, "wrap each prompt in the tokenizer's chat template")
    rollout_shuffle: bool = option(
        False, "shuffle prompts each epoch (order derived from seed, epoch)"
    )
    builtin_task: str = option(
        "addition", "built-in task when --prompt-data is unset", choices=TASKS
    )
    eval_prompt_data: str | None = option(
        None, "JSONL file for evaluation (default: the built-in task's held-out split)"
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


def _from_records(records: list[dict[str, str]]) -> list[Prompt]:
    return [Prompt(i, r["prompt"], r["label"]) for i, r in enumerate(records)]


def load_train_prompts(cfg: DataConfig) -> list[Prompt]:
    if cfg.prompt_data:
        return load_jsonl(cfg.prompt_data, cfg.input_key, cfg.label_key)
    return _from_records(builtin_task(cfg.builtin_task)[0])


def load_eval_prompts(cfg: DataConfig) -> list[Prompt] | None:
    if cfg.eval_prompt_data:
        return load_jsonl(cfg.eval_prompt_data, cfg.input_key, cfg.label_key)
    if cfg.prompt_data:
        return None
    return _from_records(builtin_task(cfg.builtin_task)[1])


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
        }

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.prompts):
            raise UserError(
                f"the checkpoint's data position is for {state['size']} prompts but the data now has "
                f"{len(self.prompts)}; resume with the same --prompt-data or use --finetune"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
