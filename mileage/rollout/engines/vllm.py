"""Rollout on vLLM's OpenAI-compatible server, launched by mileage or already running.

Generation: `POST /v1/completions` with the prompt as token ids, `logprobs: 0` (the log-prob of
each sampled token), `return_tokens_as_token_ids: true` (tokens come back as "token_id:N") and
a per-request `seed`. One request per sample, seeded with `SamplingSeed.row_seed`: vLLM batches
concurrent requests itself, and a sample does not depend on which server made it. vLLM does
not promise bit-identical samples across batch compositions, so a resumed run can differ from
an uninterrupted one in its samples (never in its start, data position, LR or optimizer state).

Weights: written as an HF directory, then `POST /collective_rpc` with method `reload_weights`
and `weights_path`, and `POST /reset_prefix_cache` (cached KV of the old weights must go).
Both are development-mode endpoints: a launched server gets `VLLM_SERVER_DEV_MODE=1`; a server
given by --rollout-url must be started with it. vLLM's replies carry no weight version, so the
client stamps the version it synced; requests go out only after every reload returned.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
import time
from pathlib import Path

import torch

from mileage.errors import UserError
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.http import BadReply, ServerPool, get_ok
from mileage.rollout.engines.launch import ServerProcess, free_port
from mileage.rollout.engines.weights import DiskWeights

SERVED_NAME = "mileage-policy"
# requests in flight per server; vLLM batches them
IN_FLIGHT = 64


def default_vllm_python() -> Path:
    from mileage.models.tiny import mileage_home

    return mileage_home() / "vllm-venv" / "bin" / "python"


def launch_vllm(cfg: EngineConfig, model_dir: str, log) -> tuple[ServerProcess, str]:
    python = Path(cfg.vllm_python) if cfg.vllm_python else default_vllm_python()
    if not python.exists():
        raise UserError(
            f"--vllm-python {python} does not exist; install vLLM with scripts/install_vllm.sh "
            "or give --rollout-url of a running server"
        )
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        *shlex.split(cfg.vllm_args),
    ]  # fmt: skip
    log_path = Path(tempfile.mkdtemp(prefix="mileage-vllm-")) / "vllm.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    server = ServerProcess(command, log_path, env)
    url = f"http://127.0.0.1:{port}"
    log(f"launching vLLM on {url} (log: {log_path})")
    deadline = time.monotonic() + cfg.vllm_start_timeout
    while not get_ok(url + "/health", timeout=5):
        if not server.running():
            raise UserError(f"the vLLM server exited while starting: {server.log_tail()}")
        if time.monotonic() > deadline:
            server.stop()
            raise UserError(
                f"the vLLM server was not healthy within {cfg.vllm_start_timeout:.0f}s "
                f"(--vllm-start-timeout): {server.log_tail()}"
            )
        time.sleep(0.5)
    log(f"vLLM is up on {url}")
    return server, url


class VLLMEngine:
    in_process = False

    def __init__(self, cfg: EngineConfig, vocab_size: int, eos_id: int, model_dir: str, log):
        self.server = None
        urls = list(cfg.rollout_url)
        if not urls:
            self.server, url = launch_vllm(cfg, model_dir, log)
            urls = [url]
        self.pool = ServerPool(urls, cfg.rollout_timeout, cfg.rollout_attempts, "vllm rollout")
        self.pool.in_flight = IN_FLIGHT
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.sync_timeout = cfg.rollout_sync_timeout
        self.weights = DiskWeights(cfg.rollout_weights_dir)
        self.weight_version = -1

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        path = self.weights.write(model)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        failed = {}
        for path_, payload in (("/collective_rpc", rpc), ("/reset_prefix_cache", {})):
            for url, why in self.pool.broadcast(path_, payload, self.sync_timeout).items():
                if why is not None:
                    failed.setdefault(url, f"{path_}: {why}")
        if len(failed) == len(self.pool.urls):
            details = "; ".join(f"{u}: {w}" for u, w in failed.items())
            raise UserError(
                f"vllm rollout: no server loaded the weights of version {version} ({details}); "
                "the last checkpoint is untouched: rerun the same command once a server is healthy"
            )
        self.pool.excluded = set(failed)
        self.weight_version = version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: SamplingSeed | None = None,
        group_size: int = 1,
    ) -> list[Completion]:
        payloads, validators = [], []
        for row, prompt in enumerate(prompts):
            payload = {
                "model": SERVED_NAME,
                "prompt": list(prompt),
                "max_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
            }
            if seed is not None:
                payload["seed"] = seed.row_seed(row)
            payloads.append(payload)
            validators.append(self._validator(prompt, params))
        return self.pool.map("/v1/completions", payloads, validators)

    def _validator(self, prompt: list[int], params: SamplingParams):
        def validate(reply) -> Completion:
            try:
                choice = reply["choices"][0]
                tokens = [
                    int(str(t).removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]
                ]
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                finish = choice["finish_reason"]
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                raise BadReply(f"malformed completion ({type(exc).__name__}: {exc})") from None
            if len(tokens) != len(logprobs) or not 1 <= len(tokens) <= params.max_new_tokens:
                raise BadReply(f"{len(tokens)} tokens, {len(logprobs)} log-probs")
            if any(not 0 <= t < self.vocab_size for t in tokens):
                raise BadReply("token id outside the vocabulary")
            if any(not math.isfinite(lp) or lp > 1e-4 for lp in logprobs):
                raise BadReply("a log-prob is not a finite number <= 0")
            if finish not in ("stop", "length"):
                raise BadReply(f"finish_reason {finish!r}")
            finished = finish == "stop" and tokens[-1] == self.eos_id
            return Completion(list(prompt), tokens, logprobs, finished, self.weight_version)

        return validate

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.weights.close()
