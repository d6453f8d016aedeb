"""Rollout on SGLang servers (or `mileage serve`) through SGLang's native HTTP API.

`POST /generate` with `input_ids` (a batch of token-id lists), one `sampling_params` dict per
row and `return_logprob: true`; each row's reply carries `meta_info.output_token_logprobs`
(`[log-prob, token id, text]` per generated token), `meta_info.finish_reason.type` ("stop" or
"length") and `meta_info.weight_version`. New weights: `POST /update_weights_from_disk` with
`model_path` and `weight_version`, or over a collective (`--rollout-weight-sync broadcast`,
`broadcast.py`).

One request carries one prompt's group of samples (or, for greedy evaluation, a fixed chunk of
prompts), and request i starts at server i mod n: whole groups are spread over the servers and
a failed request is retried on another one. Each row has its own `sampling_seed`
(`SamplingSeed.row_seed`), so the samples do not depend on which server made them.
"""

from __future__ import annotations

import math

import torch

from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.engines.broadcast import BroadcastWeights
from mileage.rollout.engines.http import BadReply, ServerPool
from mileage.rollout.engines.weights import DiskWeights

# greedy requests (evaluation) carry this many prompts each
GREEDY_CHUNK = 64


def chunk_rows(count: int, seed: SamplingSeed | None, group_size: int) -> list[range]:
    """Row ranges, one per request: a group each when sampling, fixed chunks when greedy."""
    size = group_size if seed is not None else GREEDY_CHUNK
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def parse_version(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadReply(f"weight_version {value!r} is not one mileage set") from None


class SGLangEngine:
    in_process = False

    def __init__(
        self,
        urls: list[str],
        vocab_size: int,
        timeout: float,
        attempts: int,
        sync_timeout: float,
        weights_dir: str | None,
        broadcast_from: str | None = None,
    ):
        self.pool = ServerPool(urls, timeout, attempts, "sglang rollout")
        self.vocab_size = vocab_size
        self.sync_timeout = sync_timeout
        self.weights = DiskWeights(weights_dir)
        # --rollout-weight-sync broadcast: over a collective, from this address
        self.broadcast = (
            BroadcastWeights(self.pool, sync_timeout, broadcast_from) if broadcast_from else None
        )
        self.weight_version = -1  # nothing synced yet: every reply is stale until then

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.broadcast is not None:
            self.broadcast.send(model, version)  # every server has them, or the run stops
            self.weight_version = version
            return
        path = self.weights.write(model)
        fault_point("mid_weight_sync")  # written, not yet loaded by the servers
        payload = {"model_path": str(path), "weight_version": str(version)}
        results = self.pool.broadcast("/update_weights_from_disk", payload, self.sync_timeout)
        failed = {url: why for url, why in results.items() if why is not None}
        if len(failed) == len(results):
            details = "; ".join(f"{u}: {w}" for u, w in failed.items())
            raise UserError(
                f"sglang rollout: no server loaded the weights of version {version} ({details}); "
                "the last checkpoint is untouched: rerun the same command once a server is healthy"
            )
        # a server that missed this version must not generate until a later sync reaches it
        self.pool.excluded = set(failed)
        self.pool.failed -= set(results) - set(failed)
        self.weight_version = version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: SamplingSeed | None = None,
        group_size: int = 1,
    ) -> list[Completion]:
        chunks = chunk_rows(len(prompts), seed, group_size)
        replies = self.pool.map(
            "/generate",
            [self._payload(prompts, rows, params, seed) for rows in chunks],
            [self._validator(prompts, rows, params) for rows in chunks],
        )
        return [c for reply in replies for c in reply]

    def _payload(self, prompts, rows: range, params: SamplingParams, seed) -> dict:
        sampling = []
        for row in rows:
            one = {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
            }
            if seed is not None:
                one["sampling_seed"] = seed.row_seed(row)
            sampling.append(one)
        return {
            "input_ids": [list(prompts[row]) for row in rows],
            "sampling_params": sampling,
            "return_logprob": True,
        }

    def _validator(self, prompts, rows: range, params: SamplingParams):
        def validate(reply) -> list[Completion]:
            if not isinstance(reply, list) or len(reply) != len(rows):
                raise BadReply(f"expected a list of {len(rows)} outputs")
            return [
                self._completion(prompts[row], item, params)
                for row, item in zip(rows, reply, strict=True)
            ]

        return validate

    def _completion(self, prompt: list[int], item, params: SamplingParams) -> Completion:
        try:
            meta = item["meta_info"]
            pairs = meta["output_token_logprobs"]
            tokens = [int(p[1]) for p in pairs]
            logprobs = [float(p[0]) for p in pairs]
            finish = meta["finish_reason"]["type"]
            version = parse_version(meta.get("weight_version"))
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise BadReply(f"malformed output ({type(exc).__name__}: {exc})") from None
        if not 1 <= len(tokens) <= params.max_new_tokens:
            raise BadReply(f"{len(tokens)} tokens for max_new_tokens {params.max_new_tokens}")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise BadReply("token id outside the vocabulary")
        if any(not math.isfinite(lp) or lp > 1e-4 for lp in logprobs):
            raise BadReply("a log-prob is not a finite number <= 0")
        if finish not in ("stop", "length"):
            raise BadReply(f"finish_reason {finish!r}")
        if version != self.weight_version:
            raise BadReply(
                f"generated with weight version {version}, expected {self.weight_version}"
            )
        return Completion(list(prompt), tokens, logprobs, finish == "stop", version)

    def close(self) -> None:
        self.weights.close()
        if self.broadcast is not None:
            self.broadcast.close()
