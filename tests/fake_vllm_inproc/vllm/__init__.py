"""A stand-in for vLLM's `LLM` class in the trainer's process, for the tests of `--colocate`
(CI does not install vLLM): the calls mileage makes, answered by mileage's own engine
(`mileage serve`'s `EngineServer`) in the precision asked, with per-row seeds.

As vLLM does, it seeds Python's, NumPy's and torch's global generators when it starts and
draws from torch's while it generates, so a run is exact only if the engine keeps the trainer's
random states. `reload_weights` takes a directory or an iterator of (HF name, tensor); names
the iterator does not carry keep their values; each reload is appended to $FAKE_VLLM_RELOADS.
$FAKE_VLLM_FAIL=load makes the model load fail. Sleep mode (`vllm.platforms`: available with
$FAKE_VLLM_SLEEP=1) behaves as level 2 does: `sleep` discards the weights (NaN here) and the KV
cache, `wake_up` takes the memory back by tag, and generating before both are back fails.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from mileage.serve.server import EngineServer

__version__ = "0.32.0+fake"


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int | None = None
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


def _log(line: str) -> None:
    path = os.environ.get("FAKE_VLLM_RELOADS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class LLM:
    def __init__(self, model: str, tokenizer: str, dtype: str, seed: int = 0, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL") == "load":
            raise RuntimeError("cannot allocate the KV cache")
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        # the tokenizer's directory first (the weights' has none), then the weights, as the
        # fake server does
        self.server = EngineServer(tokenizer, precision, fp32_lm_head=False)
        self.server.update_weights({"model_path": model})
        self.sleep_mode = kwargs.get("enable_sleep_mode", False)
        self.asleep: set[str] = set()  # what sleep released and no wake_up took back yet
        _log(f"start {model}")

    def sleep(self, level: int = 1) -> None:
        assert self.sleep_mode and level == 2, (self.sleep_mode, level)
        with torch.no_grad():
            for tensor in self.server.engine.model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))  # level 2 discards the weights
        self.asleep = {"weights", "kv_cache"}
        _log("sleep 2")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        for tag in tags or ["weights", "kv_cache"]:
            self.asleep.discard(tag)
            _log(f"wake {tag}")
        return not self.asleep

    def generate(self, prompts, sampling_params, use_tqdm: bool = True) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError(f"generate while asleep ({sorted(self.asleep)})")
        torch.rand(1)  # vLLM's sampler touches the global generator too
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = prompt["prompt_token_ids"]
            out = self.server.generate(
                {
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": params.max_tokens,
                        "temperature": params.temperature,
                        "top_p": params.top_p,
                        "sampling_seed": params.seed,
                    },
                }
            )
            pairs = out["meta_info"]["output_token_logprobs"]
            sample = CompletionOutput(
                [t for _, t, _ in pairs],
                [{t: Logprob(lp)} for lp, t, _ in pairs],
                out["meta_info"]["finish_reason"]["type"],
            )
            outputs.append(RequestOutput(ids, [sample]))
        return outputs

    def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights", method
        kwargs = kwargs or {}
        if kwargs.get("weights_path"):
            self.server.update_weights({"model_path": kwargs["weights_path"]})
            _log(f"path {kwargs['weights_path']}")
            return [None]
        if "weights" in self.asleep:
            raise RuntimeError("reload_weights while the weights are asleep")
        model = self.server.engine.model
        params = model.state_dict()
        count = 0
        with torch.no_grad():
            for name, tensor in kwargs["weights_iterator"]:
                params[name].copy_(tensor.to(params[name].dtype))  # a KeyError: unknown name
                count += 1
        _log(f"memory {count}")
        return [None]

    def reset_prefix_cache(self) -> bool:
        return True
