"""Rollout on SGLang servers (or `mileage serve`) through SGLang's native HTTP API.

`POST /generate` with `input_ids` (a batch of token-id lists), one `sampling_params` dict per
row and `return_logprob: true`; each row's reply carries `meta_info.output_token_logprobs`
(`[log-prob, token id, text]` per generated token), `meta_info.finish_reason.type` ("stop" or
"length") and `meta_info.weight_version`. New weights: `POST /update_weights_from_disk` with
`model_path` and `weight_version`, or over a collective (`--rollout-weight-sync broadcast`,
`broadcast.py`).

One request carries one prompt's group of samples (or, for greedy evaluation, a fixed chunk of
prompts), and request i starts at server i mod n: whole groups are spread over the servers and
a failed request is retried on another one; `--sglang-server-concurrency` requests are in
flight per server at once, and the replies are taken in submission order. Each row has its own
`sampling_seed` (`SamplingSeed.row_seed`, 31 bits), so the samples depend neither on which
server made them nor on what was in flight beside them.

SGLang honours `sampling_seed` only when started with `--enable-deterministic-inference`: each
server's `/get_server_info` is read before its first weight sync, and a server without it stops
the run (one line) unless `--allow-nondeterministic-rollout` is given.
"""

from __future__ import annotations

import torch

from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.adapters import (
    TENSOR_FORMAT,
    AdapterUpdate,
    encode_tensors,
    sglang_adapter_problem,
)
from mileage.rollout.engines.base import SamplingSeed, check_sample
from mileage.rollout.engines.broadcast import BroadcastWeights
from mileage.rollout.engines.http import BadReply, ServerPool
from mileage.rollout.engines.server_info import ServerInfo, check_seeds_honoured, read_server_info
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
        concurrency: int = 1,
        allow_nondeterministic: bool = False,
        buffer_size: int | None = None,
        log=print,
    ):
        self.pool = ServerPool(urls, timeout, attempts, "sglang rollout", log)
        # requests in flight per server (--sglang-server-concurrency): SGLang batches them
        # continuously; replies are taken in submission order, each row has its own seed
        self.pool.in_flight = concurrency
        self.vocab_size = vocab_size
        self.sync_timeout = sync_timeout
        self.weights = DiskWeights(weights_dir)
        self.allow_nondeterministic = allow_nondeterministic
        self.log = log
        self.checked: set[str] = set()  # servers known to honour sampling_seed (or accepted)
        # --rollout-weight-sync broadcast: over a collective, from this address
        self.broadcast = (
            BroadcastWeights(self.pool, sync_timeout, broadcast_from, buffer_size, self._check)
            if broadcast_from
            else None
        )
        self.weight_version = -1  # nothing synced yet: every reply is stale until then
        self.adapter: str | None = None  # the LoRA adapter requests name (adapter-only sync)

    def _check(self, infos: list[ServerInfo]) -> None:
        check_seeds_honoured(
            [i for i in infos if i.url not in self.checked], self.allow_nondeterministic, self.log
        )
        self.checked.update(i.url for i in infos)

    def _check_reachable(self) -> dict[str, str]:
        """Check each server not checked yet; those that do not answer: url -> why (they are
        treated as having failed this sync, and checked again at the next)."""
        infos, unreachable = [], {}
        for url in self.pool.urls:
            if url in self.checked:
                continue
            try:
                infos.append(read_server_info(url, self.sync_timeout))
            except UserError as exc:
                unreachable[url] = str(exc)
        self._check(infos)
        return unreachable

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.broadcast is not None:
            first = self.broadcast.group is None
            self.broadcast.send(model, version)  # every server has them, or the run stops
            if first:
                b = self.broadcast
                self.log(
                    f"sglang rollout: weights by broadcast in {b.last_buckets} bucket(s) of at "
                    f"most {b.buffer_size} bytes, as {str(b.dtype).removeprefix('torch.')}"
                )
            self.weight_version = version
            return
        path = self.weights.write(model)
        fault_point("mid_weight_sync")  # written, not yet loaded by the servers
        self.load_weights_from(path, version)

    def load_weights_from(self, path, version: int) -> None:
        """Every server loads the HF directory at `path` and labels it `version`; a server that
        fails is left out until a later sync reaches it, and when all fail the run stops."""
        unreachable = self._check_reachable()
        payload = {"model_path": str(path), "weight_version": str(version)}
        self.pool.sync(
            [("/update_weights_from_disk", payload)], version, self.sync_timeout, unreachable
        )
        self.weight_version = version

    def adapter_problem(self, rank: int, targets: list[str], from_tensor: bool) -> str | None:
        """Why these servers cannot take a LoRA adapter (the run then syncs merged weights), or
        None. Tensor updates are `mileage serve`'s (SGLang's tensor format is a pickle)."""
        for url in self.pool.urls:
            try:
                info = read_server_info(url, self.sync_timeout)
            except UserError:
                continue  # down: the sync leaves it out until it answers again
            problem = sglang_adapter_problem(info, rank, targets)
            if problem:
                return problem
            if from_tensor and not info.mileage_serve:
                raise UserError(
                    f"--lora-sync-from-tensor: {url} is SGLang, whose tensor format is a "
                    "pickle mileage does not send; drop the flag to sync the adapter through "
                    "the disk (--rollout-weights-dir on a path the servers share)"
                )
        return None

    def load_adapter(self, update: AdapterUpdate, version: int) -> None:
        """Every server loads adapter `update.name` and labels its weights `version`; requests
        name that adapter from now on. The previous adapter is then unloaded (best effort: a
        server that cannot unload it only keeps a few megabytes)."""
        unreachable = self._check_reachable()
        # a server kept from an earlier launch of this run may hold this name already
        self.pool.broadcast("/unload_lora_adapter", {"lora_name": update.name}, self.sync_timeout)
        if update.tensors is not None:
            load = (
                "/load_lora_adapter_from_tensors",
                {
                    "lora_name": update.name,
                    "config_dict": update.config,
                    "serialized_tensors": encode_tensors(update.tensors),
                    "load_format": TENSOR_FORMAT,
                },
            )
        else:
            load = ("/load_lora_adapter", {"lora_name": update.name, "lora_path": str(update.path)})
        relabel = (
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": False},
        )
        self.pool.sync([load, relabel], version, self.sync_timeout, unreachable)
        previous, self.adapter = self.adapter, update.name
        self.weight_version = version
        if previous is not None and previous != update.name:
            self.pool.broadcast("/unload_lora_adapter", {"lora_name": previous}, self.sync_timeout)

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
        payload = {
            "input_ids": [list(prompts[row]) for row in rows],
            "sampling_params": sampling,
            "return_logprob": True,
        }
        if self.adapter is not None:
            payload["lora_path"] = [self.adapter] * len(rows)
        return payload

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
        check_sample(tokens, logprobs, finish, params.max_new_tokens, self.vocab_size)
        if version != self.weight_version:
            raise BadReply(
                f"generated with weight version {version}, expected {self.weight_version}"
            )
        return Completion(list(prompt), tokens, logprobs, finish == "stop", version)

    def close(self) -> None:
        self.weights.close()
        if self.broadcast is not None:
            self.broadcast.close()
