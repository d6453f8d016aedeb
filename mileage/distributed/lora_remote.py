"""A LoRA run's weight sync to remote engines under torchrun (one process: training/lora_sync.py).

The policy is sharded by FSDP2, so no rank holds the adapter, the base or the merged weights
whole. Each sync gathers what the servers need, one tensor at a time, every rank taking part;
rank 0 alone keeps the full values (on the CPU) and talks to the servers, and whatever it
learns (a server that cannot take adapters, a one-line error) reaches every rank by broadcast,
so all ranks take the same path through the next collectives:
- first sync of a launch: the base (the trainer's own base tensors under HF names), loaded as
  full weights, exactly as the one-process sync pushes it;
- every sync: the adapter alone (a few MB), written by rank 0 in PEFT's format beside the
  servers' weights directory, or sent inside the request (--lora-sync-from-tensor), under the
  version's own name (`mileage-lora-v<version>`);
- an engine that cannot take the adapter: the merged weights W + scale * B @ A, computed by
  rank 0 from the gathered full values, on every sync, said once with the reason.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from mileage.distributed import env
from mileage.distributed.coordination import on_rank0
from mileage.distributed.parallelize import full_value
from mileage.distributed.remote import RemoteEngineOnRank0, gather_full
from mileage.models.hf import write_atomically
from mileage.models.lora import ADAPTER, save_adapter_tensors
from mileage.models.tensors import model_tensors
from mileage.rollout.engines.adapters import AdapterRefused, AdapterUpdate, adapter_name

LORA_MARK = ".lora_"  # PEFT's adapter tensors: <module>.lora_A.<adapter>.weight, lora_B
BASE_MARK = ".base_layer."  # PEFT's wrapped original layer: <module>.base_layer.weight


def hf_name(name: str) -> str:
    """A base tensor's name in the plain model (PEFT moves an adapted layer's weight under
    `base_layer`)."""
    return name.replace(BASE_MARK, ".")


class ShardedLoraSync(RemoteEngineOnRank0):
    """`RemoteEngineOnRank0` whose weight sync is the adapter alone (the base once per launch),
    or merged weights where the servers take no adapter."""

    def __init__(self, engine, policy, from_tensor: bool, log, takes_adapters: bool):
        super().__init__(engine)  # closes the other ranks' copy of the client
        self.policy = policy
        self.peft_model = policy.peft_model
        self.inner = policy.model  # the sharded module that trains
        self.from_tensor = from_tensor
        self.log = log if env.is_main() else (lambda line: None)
        self.base_synced = False
        self.said = False
        self.last_bytes = 0  # the adapter's tensor bytes, what each adapter-only sync sends
        self.merged_why: str | None = None
        self.current: Path | None = None
        self.root: Path | None = None
        self._temporary = False
        if self.engine is not None:  # rank 0: beside the full weights the servers read
            root = getattr(getattr(self.engine, "weights", None), "root", None)
            self._temporary = root is None
            self.root = (
                Path(root) / "adapters"
                if root is not None
                else Path(tempfile.mkdtemp(prefix="mileage-adapters-"))
            )
        if not takes_adapters:
            self._fall_back("it takes no adapter here")

    def _fall_back(self, why: str) -> None:
        self.merged_why = why
        self.log(
            f"LoRA: this rollout engine is given merged weights on every update ({why}); "
            "the in-process engine (--rollout-engine local) uses the adapter"
        )

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.merged_why is None and not self.base_synced:
            record = self.policy.record
            problem = on_rank0(
                lambda: self.engine.adapter_problem(
                    record["lora_rank"], record["target_modules"], self.from_tensor
                )
            )
            if problem is not None:
                self._fall_back(problem)
            else:
                self._sync_full(merged=False, version=version)
                self.base_synced = True
        if self.merged_why is not None:
            self._sync_full(merged=True, version=version)
            return
        refused = self._sync_adapter(version)
        if refused is not None:
            self._fall_back(refused)
            self._sync_full(merged=True, version=version)

    def _sync_full(self, merged: bool, version: int) -> None:
        """The base (merged=False) or the merged weights, gathered from the shards, loaded by
        the servers as full weights."""
        tensors = model_tensors(self.inner)
        if not merged:
            tensors = {n: t for n, t in tensors.items() if LORA_MARK not in n}
        full = gather_full(tensors)  # all ranks
        if full is not None:  # rank 0
            if merged:
                full = merged_weights(self.inner, full)
            full = {hf_name(n): t for n, t in full.items()}
        embedding = self.inner.get_input_embeddings().weight
        head = next(n for n, p in self.inner.named_parameters() if p is embedding)
        self.load_full_weights(full, self.inner.config, hf_name(head), version)

    def _sync_adapter(self, version: int) -> str | None:
        """This version of the adapter to the servers; None, or why they refused it."""
        trainable = {n: p for n, p in self.peft_model.named_parameters() if p.requires_grad}
        full = gather_full(trainable)  # all ranks

        def load() -> str | None:
            update = self._update(full, version)
            try:
                self.engine.load_adapter(update, version)
            except AdapterRefused as exc:
                return str(exc)
            if not self.said:
                self.said = True
                where = "in the request" if self.from_tensor else f"from {self.root}"
                self.log(
                    "LoRA: the rollout servers hold the base; each update sends the adapter "
                    f"alone ({self.last_bytes / 1e6:.2f} MB, {where}, gathered from the shards)"
                )
            return None

        refused = on_rank0(load)
        if refused is None:
            self.weight_version = version
        return refused

    def _update(self, full: dict[str, torch.Tensor], version: int) -> AdapterUpdate:
        """Rank 0: the gathered adapter under PEFT's saved names, written as a PEFT directory
        (unless sent as tensors); the previous version's directory goes once this one is
        written, as in one process."""
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(self.peft_model, state_dict=full, adapter_name=ADAPTER)
        self.last_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        name = adapter_name(version)
        config = json.loads(
            json.dumps(self.peft_model.peft_config[ADAPTER].to_dict(), default=list)
        )
        if self.from_tensor:
            return AdapterUpdate(name, self.root / name, config, tensors)
        previous, self.current = self.current, self.root / name
        base = self.policy.base
        write_atomically(
            self.current, lambda out: save_adapter_tensors(self.peft_model, tensors, out, base)
        )
        if previous is not None and previous != self.current:
            shutil.rmtree(previous, ignore_errors=True)
        return AdapterUpdate(name, self.current, config)

    def close(self) -> None:
        super().close()
        if self._temporary and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


@torch.no_grad()
def merged_weights(
    inner: torch.nn.Module, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for each adapted layer of `inner` (the PEFT-wrapped module), as PEFT's
    `get_delta_weight` computes it (16-bit CPU weights in fp32), from the full values `full`;
    the adapter tensors dropped."""
    from peft.tuners.lora import LoraLayer

    for name, layer in inner.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        weight = full[f"{name}.base_layer.weight"]
        a = full[f"{name}.lora_A.{ADAPTER}.weight"]
        b = full[f"{name}.lora_B.{ADAPTER}.weight"]
        low = a.dtype in (torch.float16, torch.bfloat16)
        delta = (b.float() @ a.float()) if low else b @ a
        if layer.fan_in_fan_out:
            delta = delta.T
        delta = (delta * layer.scaling[ADAPTER]).to(weight.dtype)
        full[f"{name}.base_layer.weight"] = weight + delta
    return {n: t for n, t in full.items() if LORA_MARK not in n}


def merged_full_values(inner: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The merged weights of the sharded PEFT-wrapped `inner` under the plain model's HF names,
    on every rank (one all-gather per tensor, every rank taking part), with an LM head of its
    own where the input embedding is tied to it."""
    full = {n: full_value(t.detach()) for n, t in model_tensors(inner).items()}
    state = {hf_name(n): t for n, t in merged_weights(inner, full).items()}
    embedding = inner.get_input_embeddings().weight
    head = next(n for n, p in inner.named_parameters() if p is embedding)
    state.setdefault("lm_head.weight", state[hf_name(head)])
    return state
