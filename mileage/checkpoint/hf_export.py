"""Crossing between native checkpoints and Hugging Face directories.

`write_release` makes SAVE/release from HF weights (`mileage convert`, the raw-mode starting
point); `export_hf` writes a native checkpoint's weights as an HF directory (`--save-hf`,
`mileage export-hf`). Both write to a temporary name and rename, so a reader never sees half.
"""

from __future__ import annotations

from pathlib import Path

from mileage.checkpoint.layout import META, RELEASE, scan_dir
from mileage.checkpoint.meta import checkpoint_meta, model_source, recorded_lora
from mileage.checkpoint.store import CheckpointState, commit_checkpoint, verify_checkpoint
from mileage.checkpoint.tensors import (
    MODEL_DIR,
    load_model_weights,
    load_tensors,
    model_tensors,
    tensor_digest,
)
from mileage.errors import UserError
from mileage.models.hf import (
    empty_causal_lm,
    load_causal_lm,
    load_tokenizer,
    read_config_json,
    write_atomically,
    write_hf_dir,
)
from mileage.models.lora import (
    LoraConfig,
    adapter_tensors,
    apply_lora,
    save_adapter,
)


def write_release(hf_checkpoint: str | Path, save_dir: str | Path) -> Path:
    """SAVE/release + tracker 'release' from an HF model: weights only, nothing to resume."""
    state = scan_dir(save_dir)
    if state.exists and (state.checkpoints or state.tracker.exists):
        raise UserError(
            f"{save_dir} already holds checkpoints or a tracker; convert into an empty directory"
        )
    model = load_causal_lm(hf_checkpoint)
    meta = checkpoint_meta(
        read_config_json(hf_checkpoint), rollout_id=None, source=model_source(hf_checkpoint, None)
    )
    return commit_checkpoint(
        save_dir, RELEASE, CheckpointState(model=model_tensors(model), meta=meta)
    )


def export_hf(
    checkpoint: str | Path, hf_checkpoint: str | Path, out: str | Path, adapter_only: bool = False
) -> Path:
    """Weights of a native checkpoint + config/tokenizer of `hf_checkpoint` -> an HF directory.

    A LoRA checkpoint gives the merged model (W + scale * B @ A on its recorded base), or with
    `adapter_only` the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors).
    """
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise UserError(f"checkpoint {checkpoint} is not usable: {problems[0]}")
    lora = recorded_lora(checkpoint)
    if lora is None and adapter_only:
        raise UserError(f"{checkpoint} holds full weights, not a LoRA adapter; drop --adapter-only")
    tokenizer = load_tokenizer(hf_checkpoint)
    if lora is None:
        model = empty_causal_lm(hf_checkpoint)
        load_model_weights(checkpoint, model)
        return write_hf_dir(model, tokenizer, out)
    peft_model = _adapted_model(checkpoint, lora, hf_checkpoint)
    if adapter_only:
        return write_atomically(
            out, lambda staging: save_adapter(peft_model, staging, lora["base"])
        )
    # merged in PEFT's float order: W + (B @ A) * scale, once, as PEFT and vLLM merge it
    return write_hf_dir(peft_model.merge_and_unload(), tokenizer, out)


def _adapted_model(checkpoint: str | Path, lora: dict, hf_checkpoint: str | Path):
    """The recorded base (checked against its digest) with the checkpoint's adapter loaded."""
    base_path = Path(lora["base"]["path"])
    if (base_path / "config.json").is_file():
        base = load_causal_lm(base_path)
    elif (base_path / META).is_file():  # raw mode: a native release/iteration as the base
        base = empty_causal_lm(hf_checkpoint)
        load_model_weights(base_path, base)
    else:
        raise UserError(f"{checkpoint} is an adapter of {base_path}, which no longer exists")
    digest = tensor_digest(model_tensors(base))
    if digest != lora["base"]["weights_sha256"]:
        raise UserError(
            f"{checkpoint} is an adapter of {base_path} as it was (weights "
            f"{lora['base']['weights_sha256'][:12]}); its weights are now {digest[:12]}"
        )
    config = LoraConfig(
        lora_rank=lora["lora_rank"],
        lora_alpha=lora["lora_alpha"],
        lora_dropout=lora["lora_dropout"],
        target_modules=",".join(lora["target_modules"]),
    )
    peft_model, _ = apply_lora(base, config, seed=0)
    load_tensors(Path(checkpoint) / MODEL_DIR, into=adapter_tensors(peft_model.get_base_model()))
    return peft_model
