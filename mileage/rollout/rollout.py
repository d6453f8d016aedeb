"""One rollout: sample answers for a batch of prompts with the current policy and score them.

Sampling for rollout N draws from a generator seeded by (seed, N), so a resumed run generates
exactly what the uninterrupted run generated.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.data import Prompt
from mileage.rollout.engines.base import Engine, SamplingParams, SamplingSeed
from mileage.rollout.rewards import RewardFn, score_all


@dataclass
class RolloutConfig:
    rollout_batch_size: int = option(16, "prompts per rollout")
    n_samples_per_prompt: int = option(8, "answers sampled per prompt (the GRPO group size)")
    rollout_temperature: float = option(1.0, "sampling temperature")
    rollout_top_p: float = option(1.0, "nucleus sampling mass")
    rollout_max_response_len: int = option(8, "max new tokens per answer")
    save_debug_rollout_data: str | None = option(
        None, "write each rollout's samples to this path template ({rollout_id})"
    )
    load_debug_rollout_data: str | None = option(
        None, "replay samples from this path template instead of generating (no engine is built)"
    )

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt


@dataclass
class Sample:
    prompt: Prompt
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # of the generating policy, per response token
    response: str
    reward: float
    finished: bool
    weight_version: int | None = None  # of the weights that generated it (None: older files)
    # per response token, the weight version that generated it (partial rollouts mix versions);
    # None in files written before it was recorded
    weight_versions: list[int] | None = None

    def oldest_version(self) -> int | None:
        """The oldest weight version among the sample's tokens (what its staleness counts)."""
        if self.weight_versions:
            return min(self.weight_versions)
        return self.weight_version


class PromptEncoder:
    """Turns prompt text into token ids, with the chat template when asked for."""

    def __init__(self, tokenizer, chat_template: bool):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

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
) -> list[Sample]:
    """`n_samples` scored answers per prompt; the samples of one prompt are contiguous."""
    expanded = [p for p in prompts for _ in range(n_samples)]
    ids = [encode(p.text) for p in expanded]
    # greedy decoding draws nothing: no seed, so a remote engine may batch it freely
    sampling_seed = None if params.greedy else SamplingSeed(seed, rollout_id)
    completions = engine.generate(ids, params, sampling_seed, group_size=n_samples)
    refused = inadmissible([c.weight_version for c in completions], engine.weight_version, 0)
    if refused is not None:
        raise UserError(
            f"rollout {rollout_id}: the engine returned samples of weight version {refused}, "
            f"expected {engine.weight_version}; refusing to train on off-policy data"
        )
    decode = encode.tokenizer.decode
    texts = [decode(c.response_ids, skip_special_tokens=True) for c in completions]
    rewards = score_all(
        reward_fn, [(p.text, t, p.label) for p, t in zip(expanded, texts, strict=True)]
    )
    return [
        Sample(
            p,
            c.prompt_ids,
            c.response_ids,
            c.logprobs,
            t,
            r,
            c.finished,
            c.weight_version,
            [c.weight_version] * len(c.response_ids),
        )
        for p, c, t, r in zip(expanded, completions, texts, rewards, strict=True)
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


def save_samples(template: str, rollout_id: int, samples: list[Sample]) -> Path:
    """Write a rollout's samples as JSON (floats round-trip exactly), atomically."""
    path = Path(template.format(rollout_id=rollout_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps({"rollout_id": rollout_id, "samples": [asdict(s) for s in samples]}))
    os.replace(temp, path)
    return path


def load_samples(
    template: str, rollout_id: int, prompts: list[Prompt], n_samples: int
) -> list[Sample]:
    """Samples saved by `save_samples`, checked against the prompts the data source drew now."""
    path = Path(template.format(rollout_id=rollout_id))
    if not path.is_file():
        raise UserError(f"--load-debug-rollout-data: {path} does not exist (rollout {rollout_id})")
    try:
        records = json.loads(path.read_text())["samples"]
        samples = [Sample(**{**r, "prompt": Prompt(**r["prompt"])}) for r in records]
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
