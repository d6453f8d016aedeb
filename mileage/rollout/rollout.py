"""One rollout: sample answers for a batch of prompts with the current policy and score them.

Sampling for rollout N draws from a generator seeded by (seed, N), so a resumed run generates
exactly what the uninterrupted run generated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.engines.base import Engine, SamplingParams, SamplingSeed
from mileage.rollout.prompts import Prompt
from mileage.rollout.rewards import RewardFn, score_all
from mileage.rollout.sample import Sample

if TYPE_CHECKING:
    from mileage.rollout.agent import Agent


@dataclass
class RolloutConfig:
    rollout_batch_size: int = option(16, "prompts per rollout")
    n_samples_per_prompt: int = option(8, "answers sampled per prompt (the GRPO group size)")
    rollout_temperature: float = option(1.0, "sampling temperature")
    rollout_top_p: float = option(1.0, "nucleus sampling mass")
    rollout_max_response_len: int = option(8, "max new tokens per answer")
    save_debug_rollout_data: str | None = option(
        None,
        "write each rollout's samples to this path template ({rollout_id}); with dynamic "
        "sampling or --partial-rollout a file holds one sampling round, all its groups, and "
        "its placeholder is the round's seed slot: write it {slot}",
    )
    load_debug_rollout_data: str | None = option(
        None, "replay samples from this path template instead of generating (no engine is built)"
    )

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt


class PromptEncoder:
    """Turns prompt text into token ids, with the chat template when asked for."""

    def __init__(self, tokenizer, chat_template: bool):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def uses_template(self, prompt: Prompt) -> bool:
        """Whether `prompt` is rendered through the chat template (a message list always is)."""
        return self.chat_template or prompt.messages is not None

    def prompt_ids(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
        """The ids of `prompt`: a message list, or its text with --apply-chat-template, through
        the chat template (with `tools` as its tools=); plain text otherwise."""
        if not self.uses_template(prompt):
            return self(prompt.text)
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(
                f"prompt {prompt.index} is a message list, which needs a tokenizer with a chat "
                "template; this tokenizer has none"
            )
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        extra = {"tools": tools} if tools else {}
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
            )
        )

    def __call__(self, text: str) -> list[int]:
        if self.chat_template:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        return self.tokenizer(text)["input_ids"]


def generate_samples(
    engine: Engine,
    encode: PromptEncoder,
    prompts: list[Prompt],
    params: SamplingParams,
    n_samples: int,
    reward_fn: RewardFn,
    seed: int,
    rollout_id: int,
    agent: Agent | None = None,
) -> list[Sample]:
    """`n_samples` scored answers per prompt; the samples of one prompt are contiguous. With an
    `agent` (every run has one) generation and scoring go through it: a generate function or the
    built-in tool loop when one is set, rewards of any form (`score_samples`)."""
    if agent is None:
        samples = single_turn_samples(engine, encode, prompts, params, n_samples, seed, rollout_id)
        rewards = score_all(
            reward_fn, [(s.prompt.text, s.response, s.prompt.label) for s in samples]
        )
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = reward
    else:
        samples = agent.generate(
            engine,
            prompts,
            params,
            n_samples,
            seed,
            rollout_id,
            lambda: single_turn_samples(
                engine, encode, prompts, params, n_samples, seed, rollout_id
            ),
        )
    refuse_offpolicy([s.weight_version for s in samples], engine.weight_version, rollout_id)
    return samples


def single_turn_samples(
    engine: Engine,
    encode: PromptEncoder,
    prompts: list[Prompt],
    params: SamplingParams,
    n_samples: int,
    seed: int,
    rollout_id: int,
) -> list[Sample]:
    """One answer per (prompt, sample) in one engine call, not yet scored (reward 0.0)."""
    expanded = [p for p in prompts for _ in range(n_samples)]
    # each prompt is tokenized once (with its chat template), not once per sample
    ids = [list(i) for i in map(encode.prompt_ids, prompts) for _ in range(n_samples)]
    # greedy decoding draws nothing: no seed, so a remote engine may batch it freely
    sampling_seed = None if params.greedy else SamplingSeed(seed, rollout_id)
    completions = engine.generate(ids, params, sampling_seed, group_size=n_samples)
    decode = encode.tokenizer.decode
    return [
        Sample(
            p,
            c.prompt_ids,
            c.response_ids,
            c.logprobs,
            decode(c.response_ids, skip_special_tokens=True),
            0.0,
            c.finished,
            c.weight_version,
            [c.weight_version] * len(c.response_ids),
        )
        for p, c in zip(expanded, completions, strict=True)
    ]


def inadmissible(versions: list[int | None], newest: int, max_staleness: int | None) -> int | None:
    """The admission rule for samples: the first version that is newer than `newest` (weights
    that do not exist yet) or more than `max_staleness` versions older (None: any age); None when
    every version is admitted. Synchronous training admits only `newest` itself (staleness 0)."""
    for version in versions:
        if version is None:
            continue  # replayed samples of files that did not record it
        if version > newest or (max_staleness is not None and newest - version > max_staleness):
            return version
    return None


def refuse_offpolicy(versions: list[int | None], newest: int, rollout_id: int) -> None:
    """Synchronous training's admission (staleness 0): a UserError (exit 2) when any of
    `versions` is not the engine's current weight version `newest`."""
    refused = inadmissible(versions, newest, 0)
    if refused is not None:
        raise UserError(
            f"rollout {rollout_id}: the engine returned tokens of weight version {refused}, "
            f"expected {newest}; refusing to train on off-policy data"
        )


def debug_path(template: str, slot: int) -> Path:
    """A debug-rollout file: `{rollout_id}` and `{slot}` name the same number, the seed slot
    the samples were drawn with (the rollout itself unless dynamic sampling or partial rollout
    spends several rounds, each a slot of its own, on one rollout)."""
    return Path(template.format(rollout_id=slot, slot=slot))


def save_samples(template: str, rollout_id: int, samples: list[Sample]) -> Path:
    """Write a rollout's samples as JSON (floats round-trip exactly), atomically."""
    path = debug_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    records = [s.to_record() for s in samples]
    temp.write_text(json.dumps({"rollout_id": rollout_id, "samples": records}))
    os.replace(temp, path)
    return path


def load_samples(
    template: str, rollout_id: int, prompts: list[Prompt], n_samples: int
) -> list[Sample]:
    """Samples saved by `save_samples`, checked against the prompts the data source drew now."""
    path = debug_path(template, rollout_id)
    if not path.is_file():
        raise UserError(f"--load-debug-rollout-data: {path} does not exist (rollout {rollout_id})")
    try:
        records = json.loads(path.read_text())["samples"]
        samples = [Sample.from_record(r) for r in records]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"--load-debug-rollout-data: {path} is not a mileage rollout file ({exc})"
        ) from None
    expected = [p.index for p in prompts for _ in range(n_samples)]
    if [s.prompt.index for s in samples] != expected:
        raise UserError(
            f"{path} holds samples for other prompts than rollout {rollout_id} draws now; replay with "
            "the data and batch flags of the original run"
        )
    return samples
