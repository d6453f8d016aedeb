"""A remote rollout engine (SGLang servers, `mileage serve`, vLLM) under torchrun.

Rank 0 talks to the servers; every rank gets the completions:
- `generate`: rank 0 sends the requests (each row seeded by `SamplingSeed.row_seed`, so the
  samples are those a single process would get from the same weights) and broadcasts the
  completions; the other ranks wait for them in that broadcast.
- `update_weights` (disk sync): every rank takes part in gathering each sharded tensor's full
  value, one tensor at a time; rank 0 alone keeps them (on the CPU), writes the HF directory the
  servers reload (`config.json` + `model.safetensors`, staged then renamed; for vLLM with an LM
  head of its own) and asks the servers to load it (a vLLM server mileage launches is started
  from the first one). No rank holds a second full model for generation.
- `--rollout-weight-sync broadcast`: bucket by bucket, every rank gathers the bucket's tensors
  from the shards and rank 0 casts them to the servers' dtype and broadcasts them to the servers
  (SGLang's update_weights_from_distributed); at most one bucket of full tensors at a time.
- A `UserError` on rank 0 (every server failed, a server ignores seeds, ...) reaches every rank
  through the same broadcast, so all ranks stop with the same one line instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mileage.checkpoint.tensors import model_tensors
from mileage.distributed import env
from mileage.distributed.coordination import on_rank0
from mileage.distributed.parallelize import full_value
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.engine import Completion, SamplingParams
from mileage.rollout.engines.weights import write_hf_weights
from mileage.rollout.rewards.journaled import ScoreOnce, in_place

T = TypeVar("T")


def gather_full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Every tensor's full value on rank 0 (on the CPU); None on the other ranks. A collective:
    every rank must call it. Tied tensors appear once, as in checkpoints."""
    return gather_full(model_tensors(model))


def gather_full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The full value of each (possibly sharded) tensor on rank 0, on the CPU, one at a time;
    None on the other ranks. A collective: every rank calls it with the same names in order."""
    full: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        whole = full_value(value.detach())
        if env.is_main():
            full[name] = whole.to("cpu", copy=True).contiguous()
        del whole
    return full if env.is_main() else None


class RemoteEngineOnRank0:
    """The `Engine` interface over all ranks, around a remote engine that rank 0 drives."""

    in_process = False  # the trainer recomputes the log-probs (logprob_abs_diff)

    def __init__(self, engine):
        self.by_broadcast = getattr(engine, "broadcast", None) is not None
        # vLLM reloads from a directory with an LM head of its own (`vllm.untie_on_disk`)
        self.untie_head = getattr(engine, "needs_untied_head", False)
        # the other ranks never talk to the servers: their copy of the engine is closed now
        if not env.is_main():
            engine.close()
        self.engine = engine if env.is_main() else None
        self.weight_version = -1

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.by_broadcast:
            self._broadcast(model, version)
            self.weight_version = version
            return
        tensors = gather_full_weights(model)  # all ranks
        embedding = model.get_input_embeddings().weight
        head = next(n for n, p in model.named_parameters() if p is embedding)
        self.load_full_weights(tensors, model.config, head, version)

    def load_full_weights(
        self, tensors: dict[str, torch.Tensor] | None, config: Any, head: str, version: int
    ) -> None:
        """The servers load `tensors` (rank 0's gathered full values, HF names; `head`: the
        input embedding's name) as `version`. Every rank calls it; rank 0 does the work."""

        def load() -> None:
            path = write_hf_weights(config, tensors, self.engine.weights.path)
            if self.untie_head and getattr(config, "tie_word_embeddings", False):
                from mileage.rollout.engines.vllm import untie_head_on_disk

                untie_head_on_disk(tensors[head], path)  # vLLM's reload skips a tied head
            fault_point("mid_weight_sync")  # written, not yet loaded by the servers
            self.engine.load_weights_from(path, version)

        on_rank0(load)
        self.weight_version = version

    def _broadcast(self, model: torch.nn.Module, version: int) -> None:
        """--rollout-weight-sync broadcast from the shards: rank 0 plans the buckets (forming the
        group at the first sync); then per bucket every rank takes part in gathering its
        tensors' full values, and rank 0 casts and sends them. After a failure rank 0 still
        gathers the remaining buckets with the others (sending nothing), so no rank is left
        waiting in a collective, and then every rank stops with its line."""
        first = self.engine is not None and self.engine.broadcast.group is None
        buckets = on_rank0(lambda: self.engine.broadcast.plan(model))
        tensors = model_tensors(model)
        error = None
        for index, names in enumerate(buckets):
            bucket = {n: full_value(tensors[n].detach()) for n in names}  # all ranks
            if env.is_main() and error is None:
                try:
                    self.engine.broadcast.send_bucket(bucket, version, index, len(buckets))
                except UserError as exc:
                    error = str(exc)
            del bucket
            if index == 0 and len(buckets) > 1:
                # on every rank: the servers hold the first bucket of the new weights only
                fault_point("mid_weight_sync")
        if env.is_main() and error is None:
            sender = self.engine.broadcast
            sender.last_buckets = len(buckets)
            self.engine.weight_version = version
            if first:
                self.engine.log(
                    f"sglang rollout: weights by broadcast in {len(buckets)} bucket(s) of at most "
                    f"{sender.buffer_size} bytes, as {str(sender.dtype).removeprefix('torch.')}, "
                    "gathered from the shards"
                )
        error = env.broadcast_object(error)
        if error is not None:
            raise UserError(error)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed=None,
        group_size: int = 1,
    ) -> list[Completion]:
        return on_rank0(lambda: self.engine.generate(prompts, params, seed, group_size))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def where_driven(engine, job: Callable[[Any], T]) -> T:
    """`job(engine)` where the engine is driven, its result on every rank.

    Under torchrun a remote engine is driven by rank 0 and its `generate` is a collective. A
    rollout that calls it once per turn and runs tools, reward functions or a user's rollout
    function between the turns runs here on rank 0 alone, with the servers' own client, and the
    finished samples reach every rank in one broadcast: each tool runs once (a tool with outside
    state cannot answer the ranks differently), and every rank trains on the same samples. In
    one process, or with the in-process engine (whose `generate` every rank joins), this is
    `job(engine)`."""
    if isinstance(engine, RemoteEngineOnRank0) and env.is_distributed():
        return on_rank0(lambda: job(engine.engine))
    return job(engine)


def once_for_all_ranks(engine) -> ScoreOnce:
    """How a reward that may answer differently when asked again (a judge, a reward server) is
    scored: by rank 0 for every rank where every rank joins the engine's `generate` (and so
    holds the same gathered samples); in place where rank 0 alone drives a remote engine
    (`where_driven`) or in one process. Asked once, the journal has one writer."""
    if env.is_distributed() and not isinstance(engine, RemoteEngineOnRank0):
        return on_rank0
    return in_place
