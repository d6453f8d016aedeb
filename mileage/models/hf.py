"""Loading Hugging Face causal LMs and tokenizers from local directories (never from a hub)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from mileage.errors import UserError  # noqa: E402

hf_logging.disable_progress_bar()


def read_config_json(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise UserError(
            f"{path} has no config.json; --hf-checkpoint must be a Hugging Face model directory"
        )
    try:
        return json.loads(file.read_text())
    except ValueError as exc:
        raise UserError(f"{file} is not valid JSON ({exc})") from None


def load_tokenizer(path: str | Path):
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a tokenizer from {path}: {exc}") from None


def require_chat_template(tokenizer, source: str) -> None:
    """--apply-chat-template on a tokenizer without one would fail mid-rollout; refuse up front."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"--apply-chat-template: the tokenizer of {source} has no chat template; "
            "drop the flag or use a model whose tokenizer defines one"
        )


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Weights and architecture from an HF directory."""
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a causal LM from {path}: {exc}") from None
    return model.eval()


def empty_causal_lm(config_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The architecture of `config_dir` with uninitialised-then-overwritten weights (for native loads)."""
    from transformers.initialization import no_init_weights

    from mileage.seeding import overwritten_allocations

    config = AutoConfig.from_pretrained(str(config_dir))
    # the weights are loaded over right after: random init (1.5 s on SmolLM2) would be wasted
    with no_init_weights(), overwritten_allocations():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights also skips the tying
    return model.eval()
