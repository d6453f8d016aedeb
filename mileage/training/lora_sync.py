"""Weight sync of a LoRA run to remote engines: the adapter alone, or merged weights.

An engine that takes adapters (SGLang or `mileage serve` started with --enable-lora, vLLM with
runtime LoRA updating) gets the base model once, at the first sync of each launch, and from
then on each new version of the adapter alone: its tensors (a few MB) instead of the model.
The base pushed at the first sync is the trainer's own base tensors, so whatever the servers
were started from, they generate with exactly the base the adapter was trained on.

An engine that cannot take the adapter (its answer or its server info says why) is given the
merged weights W + scale * B @ A on every sync instead, and the run says so once, with the
reason. Neither path changes what the trainer computes; they differ only in the float rounding
of the engine's forward (base + adapter is the trainer's own computation).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from mileage.models.hf import write_atomically
from mileage.models.lora import ADAPTER, MergedView, save_adapter
from mileage.rollout.engines.adapters import AdapterRefused, AdapterUpdate, adapter_name
from mileage.training.lora import LoraPolicy


class MergedWeightsEngine:
    """An engine that takes no adapter gets the merged weights (W + scale * B @ A) instead."""

    def __init__(self, engine, policy: LoraPolicy, config_dir: str, log, why: str = ""):
        self.engine = engine
        self.view = MergedView(policy.peft_model, config_dir)
        reason = f" ({why})" if why else " (it takes no adapter here)"
        log(
            f"LoRA: this rollout engine is given merged weights on every update{reason}; "
            "the in-process engine (--rollout-engine local) uses the adapter"
        )

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        self.engine.update_weights(self.view.refresh(), version)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def takes_adapters(engine) -> bool:
    """Whether the engine has the adapter-sync interface (SGLang, vLLM)."""
    return hasattr(engine, "load_adapter") and hasattr(engine, "adapter_problem")


class AdapterSyncEngine:
    """The base once per launch, then the adapter alone on every sync; merged weights instead
    when the engine turns out not to take adapters (said once)."""

    def __init__(self, engine, policy: LoraPolicy, config_dir: str, from_tensor: bool, log):
        self.engine = engine
        self.policy = policy
        self.config_dir = config_dir
        self.from_tensor = from_tensor
        self.log = log
        self.fallback: MergedWeightsEngine | None = None
        self.base_synced = False
        # beside the full weights the servers read (--rollout-weights-dir: a shared path)
        weights = getattr(engine, "weights", None)
        root = getattr(weights, "root", None)
        self._temporary = root is None
        self.root = (
            Path(root) / "adapters"
            if root is not None
            else Path(tempfile.mkdtemp(prefix="mileage-adapters-"))
        )
        self.current: Path | None = None
        self.last_bytes = 0  # the adapter's tensor bytes, what each adapter-only sync sends
        self.said = False

    def _fall_back(self, why: str) -> None:
        self.fallback = MergedWeightsEngine(
            self.engine, self.policy, self.config_dir, self.log, why
        )

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.fallback is None and not self.base_synced:
            record = self.policy.record
            problem = self.engine.adapter_problem(
                record["lora_rank"], record["target_modules"], self.from_tensor
            )
            if problem is not None:
                self._fall_back(problem)
            else:
                base = MergedView(self.policy.peft_model, self.config_dir, merged=False).model
                self.engine.update_weights(base, version)
                self.base_synced = True
        if self.fallback is not None:
            self.fallback.update_weights(model, version)
            return
        update = self._write(version)
        try:
            self.engine.load_adapter(update, version)
        except AdapterRefused as exc:
            self._fall_back(str(exc))
            self.fallback.update_weights(model, version)
            return
        if not self.said:
            self.said = True
            self.log(
                f"LoRA: the rollout servers hold the base; each update sends the adapter alone "
                f"({self.last_bytes / 1e6:.2f} MB, {'in the request' if self.from_tensor else 'from ' + str(self.root)})"
            )

    def _write(self, version: int) -> AdapterUpdate:
        """This version of the adapter in PEFT's format (written unless sent as tensors); the
        previous version's directory goes once the servers have loaded the new one."""
        from peft import get_peft_model_state_dict

        peft_model = self.policy.peft_model
        name = adapter_name(version)
        tensors = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)
        self.last_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        config = json.loads(json.dumps(peft_model.peft_config[ADAPTER].to_dict(), default=list))
        if self.from_tensor:
            return AdapterUpdate(name, self.root / name, config, tensors)
        previous, self.current = self.current, self.root / name
        write_atomically(self.current, lambda out: save_adapter(peft_model, out, self.policy.base))
        if previous is not None and previous != self.current:
            shutil.rmtree(previous, ignore_errors=True)
        return AdapterUpdate(name, self.current, config)

    def close(self) -> None:
        self.engine.close()
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
