"""The built-in model's supervised warm-up, run as `mileage sft`.

The warm-up is an SFT run like any user's: a freshly initialised model (from the recipe's seed)
in an HF directory, the task's training answers as JSONL, and `mileage sft` with the recipe's
flags, in a subprocess. It stops once the policy first reaches the recipe's target accuracy,
checked every `check_every` steps: each check raises `--num-rollout` and runs the same command
again, which continues the saved run bit for bit (the resume contract), then exports the weights
with `mileage export-hf` and measures them. So the weights the package ships are the output of
the same trainer, loss and checkpoint path users run, not of a second training loop.

The commands run as subprocesses rather than imports: the drivers sit above this layer, and a
first-use build happens inside another run, whose RNG, threads and signals it must not touch.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import mileage
from mileage.errors import UserError
from mileage.models.hf import load_causal_lm
from mileage.rollout import tool_task

# The tool task's demonstrations are conversations (call, calculator result, answer): their
# template writes each message's text as it is, after <bos>, so the prompt's ids are the ones a
# rollout encodes and each turn's tokens are its own.
PLAIN_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def sft_records(task: str, train: list[dict[str, str]], eos: str) -> list[dict]:
    """The warm-up's JSONL records: prompt and answer pairs, or for the tool task conversations
    whose calculator results are tool turns (read, never trained)."""
    if task != tool_task.TASK:
        return [{"prompt": r["prompt"], "label": r["label"]} for r in train]
    records = []
    for r in tool_task.warmup_records(train, eos):
        turns = [{"role": "user", "content": r["prompt"]}]
        turns += [
            {"role": "assistant" if trained else "tool", "content": text}
            for text, trained in r["segments"]
        ]
        records.append({"messages": turns, "label": r["label"]})
    return records


def sft_flags(task: str, recipe: dict, work: Path) -> list[str]:
    """`mileage sft`'s flags for the recipe; `--num-rollout` is added per check."""
    data = ["--input-key", "messages"] if task == tool_task.TASK else ["--input-key", "prompt"]
    return [
        "--hf-checkpoint", str(work / "init"),
        "--prompt-data", str(work / "data.jsonl"), *data, "--label-key", "label",
        "--rollout-shuffle",
        "--rollout-batch-size", str(recipe["batch_size"]),
        "--micro-batch-size", str(recipe["batch_size"]),
        "--calculate-per-token-loss",
        "--lr", str(recipe["lr"]),
        "--lr-warmup-iters", str(recipe["warmup_steps"]),
        "--lr-decay-style", "constant",
        "--adam-beta1", str(recipe["betas"][0]),
        "--adam-beta2", str(recipe["betas"][1]),
        "--weight-decay", str(recipe["weight_decay"]),
        "--clip-grad", str(recipe["clip_grad"]),
        "--precision", "fp32",
        "--num-threads", str(recipe["threads"]),
        "--seed", str(recipe["seed"]),
        "--save", str(work / "sft"), "--load", str(work / "sft"),
        "--save-interval", str(recipe["check_every"]),
    ]  # fmt: skip


# a command may take minutes on a slow machine; one that takes this long has hung
COMMAND_TIMEOUT_S = 3600


def _mileage(*args: str) -> str:
    """Run one mileage command; its stdout, or one line naming what failed. The fault-injection
    variables of a run that builds the model on first use are not passed on: they aim at it."""
    env = {
        k: v for k, v in os.environ.items() if k == "MILEAGE_HOME" or not k.startswith("MILEAGE_")
    }
    env["PYTHONPATH"] = str(Path(mileage.__file__).resolve().parents[1])
    command = [sys.executable, "-m", "mileage", *args]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"the built-in model's warm-up: mileage {args[0]} ran past {COMMAND_TIMEOUT_S} s"
        ) from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise UserError(f"the built-in model's warm-up: mileage {args[0]} failed: {lines[-1]}")
    return done.stdout


def sft_warm_up(
    task: str,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    train: list[dict[str, str]],
    recipe: dict,
    work: Path,
    check_fn: Callable,
    log: Callable[[str], None] = print,
) -> tuple[Path, int, tuple[float, ...]]:
    """Warm `model` (its initialisation) up with `mileage sft` in `work` until `check_fn`'s first
    value reaches the target or `max_steps` ran; returns (the exported HF directory, steps, what
    `check_fn` measured last, as a tuple)."""
    init = work / "init"
    model.save_pretrained(init)
    saved = copy.deepcopy(tokenizer)
    if task == tool_task.TASK:
        saved.chat_template = PLAIN_TEMPLATE
    saved.save_pretrained(init)
    records = sft_records(task, train, tokenizer.eos_token)
    with open(work / "data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    flags = sft_flags(task, recipe, work)
    check = train[: recipe["check_size"]]
    steps, target = 0, recipe["target_accuracy"]
    while True:
        steps = min(steps + recipe["check_every"], recipe["max_steps"])
        printed = _mileage("sft", *flags, "--num-rollout", str(steps))
        out = work / f"hf_{steps:04d}"
        _mileage("export-hf", "--load", str(work / "sft"), "--out", str(out))
        trained = load_causal_lm(out)
        checked = check_fn(trained, tokenizer, check)
        checked = checked if isinstance(checked, tuple) else (checked,)
        accuracy, *rest = checked
        loss = [line for line in printed.splitlines() if line.startswith("rollout ")]
        said = loss[-1].split(" | ")[1] if loss else ""
        extra = "".join(f" / {value:.3f}" for value in rest)
        log(f"  warm-up step {steps}  {said}  accuracy {accuracy:.3f}{extra}")
        if (target is not None and accuracy >= target) or steps >= recipe["max_steps"]:
            return out, steps, checked
        shutil.rmtree(out)
