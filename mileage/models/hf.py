"""Loading Hugging Face causal LMs and tokenizers from local directories (never from a hub)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from huggingface_hub.errors import StrictDataclassError  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from mileage.errors import UserError  # noqa: E402

hf_logging.disable_progress_bar()


def read_config_json(path: str | Path) -> dict:
    """config.json of an HF model directory, or one line saying why `path` is not one."""
    directory = Path(path)
    if not directory.exists():
        raise UserError(
            f"{path} does not exist; --hf-checkpoint must be a Hugging Face model directory"
        )
    if not directory.is_dir():
        raise UserError(f"{path} is a file; --hf-checkpoint must be a Hugging Face model directory")
    file = directory / "config.json"
    if not file.is_file():
        raise UserError(
            f"{path} has no config.json; --hf-checkpoint must be a Hugging Face model directory"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{file} is unreadable ({exc})") from None
    if not text.strip():
        raise UserError(f"{file} is empty")
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UserError(f'{file} has no "model_type"; it is not a Hugging Face model config')
    check_field_types(config, file)
    return config


# sizes every causal LM config states as a positive integer (under either naming); the size
# checks count with them before transformers reads the config, whose own check is a traceback
POSITIVE_INT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
)
NUMBER_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")


def check_field_types(config: dict, file: str | Path) -> None:
    """One line naming the first field of a known type that has another (null: not set)."""
    for name in POSITIVE_INT_FIELDS:
        value = config.get(name)
        # bool is an int to Python, never a size
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise UserError(f'{file}: "{name}" is {json.dumps(value)}; expected a positive integer')
    for name in NUMBER_FIELDS:
        value = config.get(name)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise UserError(f'{file}: "{name}" is {json.dumps(value)}; expected a number')


def config_error(path: str | Path, exc: Exception) -> UserError:
    """transformers' own check of a field's type (one it validates that ours does not know),
    as one line: its message spans several lines and repeats itself per accepted type."""
    detail = str(exc.__cause__ or exc).split(". Errors:")[0]
    detail = re.sub(r"<class '(\w+)'>", r"\1", " ".join(detail.split()))
    return UserError(f"{Path(path) / 'config.json'}: {detail}")


def check_weight_files(path: str | Path) -> None:
    """Every *.safetensors in `path` has a readable header (a truncated copy fails here, not mid-load)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # SafetensorError, OSError: whatever the reason, it is unusable
            raise UserError(f"{file} is not a readable safetensors file ({exc})") from None


def load_tokenizer(path: str | Path):
    read_config_json(path)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except StrictDataclassError as exc:
        raise config_error(path, exc) from None
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
    read_config_json(path)
    check_weight_files(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except StrictDataclassError as exc:
        raise config_error(path, exc) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a causal LM from {path}: {exc}") from None
    return model.eval()


def empty_causal_lm(
    config_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.nn.Module:
    """The architecture of `config_dir` with uninitialised-then-overwritten weights (for native
    loads); on `device` "meta", with no storage at all (torchrun ranks other than 0, which get
    their shards from rank 0 after sharding)."""
    from transformers.initialization import no_init_weights

    from mileage.seeding import overwritten_allocations

    read_config_json(config_dir)
    try:
        config = AutoConfig.from_pretrained(str(config_dir))
    except StrictDataclassError as exc:
        raise config_error(config_dir, exc) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the model config of {config_dir}: {exc}") from None
    # the weights are loaded over right after: random init (1.5 s on SmolLM2) would be wasted
    with no_init_weights(), overwritten_allocations(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights also skips the tying
    return model.eval()


# the file PEFT writes beside an adapter (an adapter directory may be replaced like a model's)
ADAPTER_CONFIG = "adapter_config.json"


def check_export_target(out: Path) -> None:
    """An existing `out` is replaced only if it is an empty directory or an HF model or adapter
    directory: a mistyped path must not cost the user a file or a folder of other things."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; choose a directory path to export to")
    if (
        out.is_dir()
        and any(out.iterdir())
        and not (out / "config.json").is_file()
        and not (out / ADAPTER_CONFIG).is_file()
    ):
        raise UserError(
            f"{out} is a non-empty directory that is not a Hugging Face model or adapter; "
            "choose a new or empty directory"
        )


def write_hf_dir(model: torch.nn.Module, tokenizer, out: str | Path) -> Path:
    """save_pretrained(model + tokenizer) into `out`, atomically (see `check_export_target`)."""

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)

    return write_atomically(out, write)


def write_atomically(out: str | Path, write: Callable[[Path], None]) -> Path:
    """`write` into a staging directory beside `out`, then rename it to `out`."""
    out = Path(out)
    check_export_target(out)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(staging)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
