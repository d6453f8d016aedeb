"""A LoRA run's policy: which base it trains on, where its adapter starts, what a checkpoint
records of both (remote engines' weight sync: training/lora_sync.py).

A LoRA checkpoint is an ordinary checkpoint whose model/ holds the adapter tensors only (their
optimizer state, RNG and trainer state are as in any checkpoint). Its meta.json `lora` entry
names the adapter's shape and the base it belongs to, by path and by a digest of the base's
tensors, so a resume on another base stops with both named instead of training nonsense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mileage.checkpoint.layout import META
from mileage.checkpoint.meta import recorded_lora
from mileage.checkpoint.tensors import MODEL_DIR, load_tensors, model_tensors, tensor_digest
from mileage.errors import UserError
from mileage.models.lora import (
    AdapterDisabled,
    LoraConfig,
    adapter_tensors,
    apply_lora,
    load_adapter,
)


@dataclass
class LoraPolicy:
    peft_model: object  # peft.PeftModel; its get_base_model() is the module that trains
    record: dict  # meta.json's `lora` entry: rank, alpha, dropout, targets, base

    @property
    def model(self) -> torch.nn.Module:
        return self.peft_model.get_base_model()

    @property
    def base(self) -> dict:
        return self.record["base"]

    def reference(self) -> AdapterDisabled:
        """The base model without a second copy: the policy run with its adapter switched off."""
        return AdapterDisabled(self.peft_model)


def base_record(model: torch.nn.Module, path: str) -> dict:
    return {
        "path": str(Path(path).resolve()),
        "weights_sha256": tensor_digest(model_tensors(model)),
    }


def _flags_of(record: dict) -> str:
    return (
        f"--lora-rank {record['lora_rank']} --lora-alpha {record['lora_alpha']} "
        f"--target-modules {','.join(record['target_modules'])}"
    )


def refuse_adapter_without_lora(checkpoint: str, fmt: str) -> None:
    """--lora-rank 0 on a LoRA checkpoint: say what to pass instead of failing on tensor names."""
    recorded = recorded_lora(checkpoint) if fmt == "native" else None
    if recorded is not None:
        raise UserError(
            f"{checkpoint} holds a LoRA adapter, not full weights; continue it with "
            f"{_flags_of(recorded)} (and --lora-dropout {recorded['lora_dropout']})"
        )


def _check_fits(checkpoint: str, recorded: dict, ours: dict) -> None:
    theirs_base, our_base = recorded.get("base", {}), ours["base"]
    if theirs_base.get("weights_sha256") != our_base["weights_sha256"]:
        raise UserError(
            f"{checkpoint} is an adapter of {theirs_base.get('path')} (weights "
            f"{str(theirs_base.get('weights_sha256'))[:12]}), but this run's base is "
            f"{our_base['path']} (weights {our_base['weights_sha256'][:12]}); "
            f"pass the base it was trained on"
        )
    keys = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules")
    diffs = [f"{k}: {recorded.get(k)} -> {ours[k]}" for k in keys if recorded.get(k) != ours[k]]
    if diffs:
        raise UserError(
            f"{checkpoint} was trained with other LoRA flags ({'; '.join(diffs)}); "
            f"continue it with {_flags_of(recorded)}"
        )


def build_lora_policy(
    cfg: LoraConfig,
    seed: int,
    weights_from: tuple[str, str],
    base_from: tuple[str, str],
    resume: bool,
    load_weights: Callable[[str, str], torch.nn.Module],
    log,
) -> LoraPolicy:
    """The base with an adapter: from the LoRA checkpoint `weights_from` if it is one (its base
    is `base_from`, the mode's fresh source), else fresh (or from --lora-adapter-path) on the
    weights of `weights_from`."""
    path, fmt = weights_from
    recorded = recorded_lora(path) if fmt == "native" else None
    if resume and recorded is None:
        raise UserError(
            f"{path} holds full weights and their optimizer state, not a LoRA adapter; resume "
            "it without --lora-rank, or start an adapter on it with --finetune"
        )
    base_path, base_fmt = base_from if recorded is not None else weights_from
    base = load_weights(base_path, base_fmt)
    record_base = base_record(base, base_path)
    peft_model, targets = apply_lora(base, cfg, seed)
    policy = LoraPolicy(peft_model, {**cfg.record(targets), "base": record_base})
    if recorded is not None:
        _check_fits(path, recorded, policy.record)
        load_tensors(Path(path) / MODEL_DIR, into=adapter_tensors(policy.model))
        if cfg.lora_adapter_path:
            log(f"--lora-adapter-path ignored: the adapter continues from {path}")
        log(f"LoRA adapter from {path} on base {base_path}")
    elif cfg.lora_adapter_path:
        load_adapter(peft_model, cfg.lora_adapter_path, cfg, targets, record_base)
        log(f"LoRA adapter from {cfg.lora_adapter_path} on base {base_path}")
    trainable = sum(p.numel() for p in adapter_tensors(policy.model).values())
    total = sum(p.numel() for p in policy.model.parameters())
    log(
        f"LoRA rank {cfg.lora_rank} on {','.join(targets)}: {trainable:,} of {total:,} "
        f"parameters train ({100 * trainable / total:.2f}%)"
    )
    return policy


def recorded_config(record: dict) -> LoraConfig:
    """The LoRA flags a checkpoint's `lora` entry records."""
    return LoraConfig(
        lora_rank=record["lora_rank"],
        lora_alpha=record["lora_alpha"],
        lora_dropout=record["lora_dropout"],
        target_modules=",".join(record["target_modules"]),
    )


def recorded_base(checkpoint: str, record: dict) -> tuple[str, str]:
    """(path, format) of the base a LoRA checkpoint's `lora` entry records: an HF directory, or
    in raw mode a native release/iteration."""
    path = Path(record["base"]["path"])
    if (path / "config.json").is_file():
        return str(path), "hf"
    if (path / META).is_file():
        return str(path), "native"
    raise UserError(f"{checkpoint} is an adapter of {path}, which no longer exists")


def restore_recorded_policy(
    checkpoint: str, load_weights: Callable[[str, str], torch.nn.Module], log
) -> LoraPolicy:
    """A LoRA checkpoint's policy as training generated with it (`mileage eval`): its recorded
    base (checked against the recorded digest) with the checkpoint's adapter, unmerged; merged
    weights (W + B @ A * scale) differ in the last bits, so sampled answers would not repeat."""
    record = recorded_lora(checkpoint)
    assert record is not None, checkpoint
    return build_lora_policy(
        recorded_config(record),
        0,  # the adapter's initialisation seed: every adapter tensor is then loaded
        (checkpoint, "native"),
        recorded_base(checkpoint, record),
        True,
        load_weights,
        log,
    )
