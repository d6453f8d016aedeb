"""The built-in default model for a built-in task: the ~3M-parameter Llama of `models/tiny.py`
with a tokenizer of the task's characters.

`ensure_builtin_model(task)` returns a plain Hugging Face directory (config.json,
model.safetensors, tokenizer.json) holding that model after a short supervised warm-up (`mileage sft`, rollout/builtin_warmup.py), so the
rest of mileage treats it exactly like any `--hf-checkpoint`. The directory is cached under
`$MILEAGE_HOME` (default `~/.cache/mileage`).

The warm-up is deterministic on one CPU but not across CPUs: matmul kernels for AVX2, AVX-512
and AMX sum in different orders, and 200 optimizer steps turn those last bits into another
model. So the tasks in `SHIPPED_WEIGHTS` ship their fp32 weights inside the package (written by
`scripts/build_builtin_model.py`, checked against the sha256 pinned here) and every machine
starts from the same bits without a minute of training. Other tasks are warmed up on first use,
reproducibly on that CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mileage.errors import UserError
from mileage.models import tiny
from mileage.models.tiny import build_char_tokenizer, mileage_home, tiny_llama_config
from mileage.rollout import tool_task
from mileage.rollout.builtin_warmup import sft_warm_up
from mileage.rollout.tasks import builtin_alphabet, builtin_task

WARMUP_RECIPE = {
    "seed": 1234,
    "max_steps": 400,
    # stop once greedy accuracy on a fixed slice of the training split reaches this: RL then
    # starts from a weak policy with real reward, wherever the sharp SFT transition falls (at
    # 0.3 the stop fell at the transition itself, where sampled answers are still rare: 0.13 of
    # the held-out sums on the AMX Xeon, against 0.20 at 0.4)
    "target_accuracy": 0.4,
    "check_every": 10,
    "check_size": 256,
    "batch_size": 128,
    "lr": 1e-3,
    "warmup_steps": 100,
    "betas": (0.9, 0.98),
    "clip_grad": 1.0,
    "weight_decay": 0.01,  # torch AdamW's default, which the loop before `mileage sft` used
    "threads": 2,
    # 4: run as `mileage sft` (rollout/builtin_warmup.py) instead of a loop of its own
    "version": 4,
}
# Per task changes to the recipe. For `addition-tool` the greedy accuracy is not the point of
# the warm-up (the direct answer should stay weak and the tool be called only sometimes); what it
# needs is enough steps to write calls and copy results.
TASK_RECIPES = {
    tool_task.TASK: {
        "max_steps": 600,
        # stop once the tool path works more often than not (greedy accuracy with every answer
        # calling the tool): copying a call and a result is learned long before adding, so the
        # direct answers are still weak then, which is what RL starts from (measured on the AMX
        # Xeon: 0.62 against 0.20 after 325 steps)
        "target_accuracy": 0.55,
        "batch_size": 64,
        "check_every": 25,
        "check_size": 128,
        "threads": 1,
    }
}
# The weights shipped in the package (mileage/models/builtin/TASK.safetensors, fp32, exactly as
# `save_pretrained` writes them) and their sha256. A damaged install or a Git LFS pointer in
# place of the file fails this pin instead of loading other weights. Rebuild and re-pin with
# `python scripts/build_builtin_model.py --task TASK`.
SHIPPED_DIR = Path(tiny.__file__).resolve().parent / "builtin"
SHIPPED_WEIGHTS = {
    "addition": "ae9c8d16dcfc670b0f9287345eb8f8d958c33c37165725b2f7517b5ea86389d3",
    "addition-tool": "ba4de62c1afbed26cd7ec3310f6387bce339f110089e7e3bbd9f876e03c492f8",
}


def warmup_recipe(task: str) -> dict:
    return {**WARMUP_RECIPE, **TASK_RECIPES.get(task, {})}


def builtin_tokenizer(task: str) -> PreTrainedTokenizerFast:
    """The character tokenizer of the built-in model for `task`."""
    return build_char_tokenizer(builtin_alphabet(task))


def builtin_config(task: str) -> LlamaConfig:
    """The architecture of the built-in model for `task` (its vocabulary depends on the task)."""
    return _builtin_config(builtin_tokenizer(task))


def builtin_model_dir(task: str) -> Path:
    """Where the model for `task` lives; the name changes whenever its weights (or recipe) do."""
    if task in SHIPPED_WEIGHTS:
        return mileage_home() / "builtin" / f"tiny-{task}-{SHIPPED_WEIGHTS[task][:12]}"
    key = json.dumps({"task": task, **warmup_recipe(task)}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return mileage_home() / "builtin" / f"tiny-{task}-{digest}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def greedy_accuracy(model, tokenizer, records) -> float:
    from mileage.rollout.engine import LocalEngine, SamplingParams

    engine = LocalEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    decoded = [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in out]
    return sum(d == r["label"] for d, r in zip(decoded, records, strict=True)) / len(records)


def build_warmed_up_model(task: str, work: Path, log=print) -> tuple[Path, dict]:
    """The warm-up from a fixed seed, run as `mileage sft` in `work`: (its exported HF directory,
    provenance). Bit-identical on one CPU."""
    recipe = warmup_recipe(task)
    # fork_rng: a run that builds the model leaves the global RNG as one that found it cached
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        tokenizer = builtin_tokenizer(task)
        model = LlamaForCausalLM(_builtin_config(tokenizer))
    train, _ = builtin_task(task)
    check_fn = tool_task.warmup_check if task == tool_task.TASK else greedy_accuracy
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe["threads"])  # the checks, as the runs they measure
    try:
        out, steps, checked = sft_warm_up(
            task, model, tokenizer, train, recipe, work, check_fn, log=log
        )
    finally:
        torch.set_num_threads(previous_threads)
    info = {"task": task, **recipe, "steps": steps, "accuracy": checked[0]}
    if task == tool_task.TASK:
        # the provenance records the warmed policy as RL finds it: its accuracy as it chooses
        tool_path, accuracy, tool_rate = checked
        info |= {
            "accuracy": accuracy,
            "greedy_tool_use_rate": tool_rate,
            "greedy_accuracy_calling_the_tool": tool_path,
        }
    return out, info


def build_builtin_weights(task: str, out_dir: Path, log=print) -> Path:
    """Warm up `task` and write OUT_DIR/TASK.safetensors plus TASK.json (provenance, sha256): the
    files that ship in the package. Used by scripts/build_builtin_model.py."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        exported, info = build_warmed_up_model(task, Path(tmp), log=log)
        weights = out_dir / f"{task}.safetensors"
        os.replace(exported / "model.safetensors", weights)
    info["sha256"] = file_sha256(weights)
    info["built_on"] = {
        "cpu": _cpu_model() or platform.processor(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out_dir / f"{task}.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return weights


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return None


def _builtin_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return tiny_llama_config(
        len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )


def _unpack_shipped(task: str, expected: str, staging: Path) -> None:
    """The shipped weights, verified against the pin, plus the config and tokenizer around them."""
    source = SHIPPED_DIR / f"{task}.safetensors"
    if not source.is_file():
        raise UserError(
            f"the built-in {task} model's weights are missing from this install ({source}); "
            "reinstall mileage"
        )
    weights = staging / "model.safetensors"
    shutil.copyfile(source, weights)
    actual = file_sha256(weights)  # the copy is what runs load, so the copy is what is checked
    if actual != expected:
        raise UserError(
            f"{source} is damaged ({source.stat().st_size} bytes, sha256 {actual[:16]}..., "
            f"expected {expected[:16]}...); reinstall mileage, or in a git clone restore the "
            "file (a Git LFS pointer is not the file)"
        )
    sidecar = SHIPPED_DIR / f"{task}.json"
    info = json.loads(sidecar.read_text()) if sidecar.is_file() else {"task": task}
    _complete(task, staging, {**info, "source": "shipped"})


def _build_here(task: str, staging: Path, log) -> None:
    with tempfile.TemporaryDirectory(dir=staging.parent) as tmp:
        exported, info = build_warmed_up_model(task, Path(tmp), log=log)
        os.replace(exported / "model.safetensors", staging / "model.safetensors")
    _complete(task, staging, {**info, "source": "built here"})


def _complete(task: str, staging: Path, info: dict) -> None:
    """The config and tokenizer around `staging`'s weights, and where they came from."""
    tokenizer = builtin_tokenizer(task)
    config = _builtin_config(tokenizer)
    # what save_pretrained adds: vLLM and SGLang pick the model class by `architectures`
    config.architectures = [LlamaForCausalLM.__name__]
    config.dtype = torch.float32
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "mileage_builtin.json").write_text(json.dumps(info))


def ensure_builtin_model(task: str, log=print) -> Path:
    """Return the HF directory of the built-in model for `task`, unpacking (shipped tasks) or
    building it (the others) into the cache the first time."""
    target = builtin_model_dir(task)
    weights = target / "model.safetensors"
    expected = SHIPPED_WEIGHTS.get(task)
    if expected is None and weights.exists():
        return target
    if expected is not None and weights.is_file():
        # ~20 ms for 13 MB: a cache damaged on disk is caught here rather than trained from
        if file_sha256(weights) == expected:
            return target
        log(f"{weights} is not the shipped built-in {task} model; unpacking it again")
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if expected is None:
            log(
                f"building the built-in {task} model (one-time, a few minutes) into {target}; "
                "it is reproducible on this CPU, not across CPU instruction sets"
            )
            _build_here(task, staging, log)
        else:
            _unpack_shipped(task, expected, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if expected is None:
        log(f"built-in model ready in {time.perf_counter() - started:.0f}s")
    return target


def _publish(staging: Path, target: Path) -> None:
    """Rename the finished directory into place; a damaged one there is moved aside first."""
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        with contextlib.suppress(OSError):  # another process replaced it already
            os.rename(target, aside / "dir")
        shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):  # another process finished first; same weights
        os.rename(staging, target)
