"""`--rollout-engine vllm --colocate`: vLLM's own `LLM` class inside the trainer's process.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the trainer's
tensors reach vLLM's in-place reloader without a copy through a file or a socket: every sync
hands the worker's `reload_weights(weights_iterator=...)` one iterator over the state dict, each
tensor cast to the engine's dtype as it is consumed (one cast tensor alive at a time). One call
per sync, not one per bucket: the reloader puts back, from the checkpoint it first loaded, the
weights of a layer that a call did not carry, so buckets that split a layer would sample from
mixed weights (measured, docs/engines.md). The model is loaded once from a directory written
with an untied LM head (vLLM 0.32's reloader does not reload a tied head, `untie_on_disk`).

Rows are sampled with per-row seeds, the same `seed` field the launched server gets, so a row's
sample depends on nothing batched with it and a resumed run draws the same samples.

Under torchrun every rank holds an engine of its own (`distributed/colocated.py` says why and
how): vLLM started in a process whose torch.distributed is initialized builds its groups from
the trainer's world, so it starts on every rank (`external_launcher`) or on none.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shlex
from collections.abc import Iterator
from pathlib import Path

import torch

from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.base import RowSeeds, SamplingSeed, check_sample
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.http import BadReply
from mileage.rollout.engines.vllm import NEUTRAL_SAMPLING, untie_on_disk
from mileage.rollout.engines.weights import DiskWeights, write_hf_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def import_vllm():
    """vLLM with its engine core in this process, or one line saying how to get it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the reloader must see our tensors
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except Exception as exc:  # ImportError, or a vLLM that fails on this torch
        raise UserError(
            f"--colocate runs vLLM inside this process, and `import vllm` fails here "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}); install "
            "vLLM beside mileage (docs/engines.md, 'vLLM in the trainer's process'), or drop "
            "--colocate to launch a vLLM server from --vllm-python"
        ) from None
    return vllm, TokensPrompt


def on_gpu() -> bool:
    return torch.cuda.is_available()


def free_gpu_memory() -> float | None:
    """GiB free on this process's GPU (None without one)."""
    return torch.cuda.mem_get_info()[0] / 2**30 if on_gpu() else None


def gpu_memory_utilization(vllm_args: str) -> float:
    """The share of the GPU vLLM may take beside the trainer: `--gpu-memory-utilization` of
    --vllm-args, else 0.3. The other `vllm serve` flags configure a server; refused here."""
    words = shlex.split(vllm_args)
    share = 0.3
    while words:
        word = words.pop(0)
        if word.startswith("--gpu-memory-utilization"):
            value = word.partition("=")[2] or (words.pop(0) if words else "")
            try:
                share = float(value)
            except ValueError:
                share = -1.0
            if not 0.0 < share < 1.0:
                raise UserError(
                    f"--vllm-args: --gpu-memory-utilization must be in (0, 1), got {value!r}"
                )
            continue
        raise UserError(
            f"--vllm-args {word}: with --colocate vLLM runs in this process, where only "
            "--gpu-memory-utilization applies (the rest configures a `vllm serve` server)"
        )
    return share


def sleep_mode(vllm, asked: bool | None) -> bool:
    """Whether the engine sleeps while training runs (--offload-rollout): where vLLM's platform
    supports it (CUDA, ROCm, XPU) unless --no-offload-rollout; asked for where it does not, one
    line (exit 2)."""
    from vllm.platforms import current_platform

    available = bool(current_platform.is_sleep_mode_available())
    if asked and not available:
        raise UserError(
            "--offload-rollout uses vLLM's sleep mode, which vLLM supports on CUDA, ROCm and "
            f"XPU GPUs only (here: {vllm.__version__} on {current_platform.device_type or 'cpu'}); "
            "drop the flag: on this machine the engine's memory stays allocated"
        )
    return available if asked is None else asked


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """The process's random states as they were before: vLLM seeds Python's, NumPy's and
    torch's global generators when it starts (`seed=0`) and may draw from them, and those
    states belong to the trainer (its checkpoints save them; a resumed run restores them)."""
    import numpy as np  # vLLM's dependency, so present wherever this engine runs

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's HF-named tensors, with an LM head of its own (the engine was loaded untied)."""
    state = model.state_dict()
    head = model.get_output_embeddings()
    if "lm_head.weight" not in state and head is not None:
        state["lm_head.weight"] = head.weight
    return state


def engine_tensors(
    state: dict[str, torch.Tensor], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`state`'s tensors for vLLM's reloader, cast one at a time."""
    for index, (name, tensor) in enumerate(state.items()):
        if index == len(state) // 2:
            fault_point("mid_weight_sync")  # half the tensors handed over
        yield name, tensor.detach().to(dtype)


class ColocatedVLLM:
    in_process = False  # log-probs come from vLLM's kernels: the trainer recomputes them

    # under torchrun: vLLM joins the trainer's process group, one engine per rank
    external_launcher = False

    def __init__(
        self, cfg: EngineConfig, vocab_size: int, eos_id: int, model_dir: str, log, dtype: str
    ):
        self.vllm, self.tokens_prompt = import_vllm()
        self.model_dir, self.log, self.dtype = model_dir, log, dtype
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.llm = None  # built at the first sync, from the trainer's weights
        self.weights = DiskWeights(cfg.rollout_weights_dir)
        self.weight_version = -1
        self.sleeps = sleep_mode(self.vllm, cfg.offload_rollout)
        self.asleep = False
        self.gpu_share = gpu_memory_utilization(cfg.vllm_args)
        self.said_memory = False

    def _start(self, path: Path) -> None:
        try:
            with kept_rng():
                self.llm = self.vllm.LLM(
                    model=str(path),
                    tokenizer=self.model_dir,
                    dtype=self.dtype,
                    seed=0,
                    enforce_eager=True,
                    enable_prefix_caching=False,  # cached prefixes would outlive an update
                    enable_sleep_mode=self.sleeps,
                    # on a GPU the trainer needs the rest (TRL's colocate default: 0.3)
                    **({"gpu_memory_utilization": self.gpu_share} if on_gpu() else {}),
                    **(
                        {"distributed_executor_backend": "external_launcher"}
                        if self.external_launcher
                        else {}
                    ),
                )
        except Exception as exc:
            raise UserError(
                f"--colocate: vLLM could not load the model ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        self.log(
            f"colocated vLLM {self.vllm.__version__} in this process ({self.dtype}); "
            + (
                "sleep mode: its weights and KV cache are released while training runs"
                if self.sleeps
                else "no sleep mode: its weights and KV cache stay allocated"
            )
        )

    def release(self) -> None:
        """The rollout's generation is over: give the engine's memory to training until the
        next update (vLLM's sleep level 2 discards weights and KV cache; every update hands
        over all the weights anyway)."""
        if self.sleeps and self.llm is not None and not self.asleep:
            before = free_gpu_memory()
            with kept_rng():
                self.llm.sleep(level=2)
            self.asleep = True
            self._say_memory("asleep", before)

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.llm is None:  # loaded once from the disk, with its own LM head
            path = self.weights.write(model)
            untie_on_disk(model, path)
            self._start(path)
        else:
            self._reload(model_state(model))
        self.weight_version = version

    def _reload(self, state: dict[str, torch.Tensor]) -> None:
        """Every tensor of `state` into the engine; a sleeping engine takes its weights' memory
        back first and its KV cache after (the order vLLM's RL users follow: the weights are
        written before the cache competes for the memory)."""
        tensors = engine_tensors(state, DTYPES[self.dtype])
        waking, before = self.asleep, free_gpu_memory()
        with kept_rng():
            if waking:
                self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
            if waking:
                self.llm.wake_up(tags=["kv_cache"])
                self.asleep = False
        if waking:
            self._say_memory("awake", before)
            self.said_memory = True  # once: the first sleep and wake of the run

    def _say_memory(self, state: str, before: float | None) -> None:
        """The GPU memory free before and after the first sleep and wake (mem_get_info)."""
        after = free_gpu_memory()
        if before is not None and after is not None and not self.said_memory:
            self.log(f"colocated vLLM {state}: GPU memory free {before:.2f} -> {after:.2f} GiB")

    def load_full(self, config, state: dict[str, torch.Tensor], version: int, directory: str):
        """Under torchrun: `state`, the full values of the policy's shards (HF names, with an
        LM head of its own), gathered onto this rank. The first loads vLLM from them written to
        `directory` (this rank's own), every later one goes to the reloader in memory."""
        if self.llm is None:  # with an LM head of its own, as `untie_on_disk` writes it
            untied = copy.deepcopy(config)
            untied.tie_word_embeddings = False
            tensors = {**state, "lm_head.weight": state["lm_head.weight"].clone()}
            self._start(write_hf_weights(untied, tensors, self.weights.root / directory))
        else:
            self._reload(state)
        self.weight_version = version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: SamplingSeed | RowSeeds | None = None,
        group_size: int = 1,
    ) -> list[Completion]:
        if self.llm is None or self.asleep:  # its weights were discarded: an update comes first
            raise RuntimeError("ColocatedVLLM.generate before an update_weights")
        rows = [
            self.vllm.SamplingParams(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                logprobs=0,
                seed=None if seed is None else seed.row_seed(row),
                **NEUTRAL_SAMPLING,
            )
            for row in range(len(prompts))
        ]
        inputs = [self.tokens_prompt(prompt_token_ids=list(p)) for p in prompts]
        with kept_rng():
            outputs = self.llm.generate(inputs, rows, use_tqdm=False)
        completions = []
        for prompt, out in zip(prompts, outputs, strict=True):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [float(d[t].logprob) for d, t in zip(sample.logprobs, tokens, strict=True)]
            try:
                check_sample(
                    tokens, logprobs, sample.finish_reason, params.max_new_tokens, self.vocab_size
                )
            except BadReply as exc:  # in this process there is no other server to retry on
                raise UserError(f"--colocate: vLLM returned an unusable sample ({exc})") from None
            finished = sample.finish_reason == "stop" and tokens[-1] == self.eos_id
            completions.append(
                Completion(list(prompt), tokens, logprobs, finished, self.weight_version)
            )
        return completions

    def close(self) -> None:
        self.llm = None
        self.weights.close()
