"""The built-in default model: a ~3M-parameter Llama with a character-level tokenizer.

`ensure_builtin_model(task)` returns a plain Hugging Face directory (config.json,
model.safetensors, tokenizer.json) holding that model after a short supervised warm-up, so the
rest of mileage treats it exactly like any `--hf-checkpoint`. The directory is cached under
`$MILEAGE_HOME` (default `~/.cache/mileage`) and keyed by everything that shapes the weights;
building it twice gives bit-identical weights (fixed seed, fixed thread count, fixed data order).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mileage.rollout.tasks import builtin_alphabet, builtin_task

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
WARMUP_RECIPE = {
    "seed": 1234,
    "max_steps": 400,
    # stop once greedy accuracy on a fixed slice of the training split reaches this: RL then
    # starts from a weak policy with real reward, wherever the sharp SFT transition falls
    "target_accuracy": 0.3,
    "check_every": 10,
    "check_size": 256,
    "batch_size": 128,
    "lr": 1e-3,
    "warmup_steps": 100,
    "betas": (0.9, 0.98),
    "clip_grad": 1.0,
    "threads": 2,
    "version": 3,
}


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character plus <pad>/<bos>/<eos>/<unk>; every encoding starts with <bos>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_llama_config(
    vocab_size: int,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 704,
) -> LlamaConfig:
    """The built-in architecture (3.2M parameters at the defaults); tests shrink it further."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def mileage_home() -> Path:
    return Path(os.environ.get("MILEAGE_HOME", Path.home() / ".cache" / "mileage"))


def builtin_model_dir(task: str) -> Path:
    """Where the warmed-up model for `task` lives; the name changes whenever the recipe does."""
    key = json.dumps({"task": task, **WARMUP_RECIPE}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return mileage_home() / "builtin" / f"tiny-{task}-{digest}"


def _warmup_batches(tokenizer, records, batch_size: int, generator: torch.Generator):
    """Endless stream of (input_ids, attention_mask, labels) for supervised warm-up."""
    eos = tokenizer.eos_token
    while True:
        order = torch.randperm(len(records), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [records[i] for i in order[start : start + batch_size]]
            prompts = [tokenizer(r["prompt"])["input_ids"] for r in chosen]
            answers = [
                tokenizer(r["label"] + eos, add_special_tokens=False)["input_ids"] for r in chosen
            ]
            width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
            ids = torch.full((batch_size, width), tokenizer.pad_token_id)
            mask = torch.zeros((batch_size, width), dtype=torch.long)
            labels = torch.full((batch_size, width), -100)
            for row, (p, a) in enumerate(zip(prompts, answers, strict=True)):
                seq = p + a
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
                labels[row, len(p) : len(seq)] = torch.tensor(a)
            yield ids, mask, labels


def greedy_accuracy(model, tokenizer, records) -> float:
    from mileage.rollout.engine import LocalEngine, SamplingParams

    engine = LocalEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    decoded = [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in out]
    return sum(d == r["label"] for d, r in zip(decoded, records, strict=True)) / len(records)


def warm_up(model, tokenizer, records, recipe: dict, log=print) -> tuple[int, float]:
    """Supervised warm-up until the target accuracy; returns (steps, accuracy)."""
    generator = torch.Generator().manual_seed(recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=recipe["betas"])
    batches = _warmup_batches(tokenizer, records, recipe["batch_size"], generator)
    check = records[: recipe["check_size"]]
    accuracy = 0.0
    for step in range(1, recipe["max_steps"] + 1):
        model.train()
        for group in opt.param_groups:
            group["lr"] = recipe["lr"] * min(1.0, step / recipe["warmup_steps"])
        ids, mask, labels = next(batches)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["clip_grad"])
        opt.step()
        if step % recipe["check_every"] == 0:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, check)
            log(f"  warm-up step {step}  loss {loss.item():.3f}  accuracy {accuracy:.3f}")
            if accuracy >= recipe["target_accuracy"]:
                break
    model.eval()
    return step, accuracy


def ensure_builtin_model(task: str, log=print) -> Path:
    """Build (once) and return the HF directory of the warmed-up built-in model for `task`."""
    target = builtin_model_dir(task)
    if (target / "model.safetensors").exists():
        return target
    log(f"building the built-in {task} model (one-time, ~1 min) into {target}")
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(WARMUP_RECIPE["threads"])
    try:
        # fork_rng: a run that builds the model leaves the global RNG as one that found it cached
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(WARMUP_RECIPE["seed"])
            tokenizer = build_char_tokenizer(builtin_alphabet())
            config = tiny_llama_config(
                len(tokenizer),
                tokenizer.pad_token_id,
                tokenizer.bos_token_id,
                tokenizer.eos_token_id,
            )
            model = LlamaForCausalLM(config)
            train, _ = builtin_task(task)
            steps, accuracy = warm_up(model, tokenizer, train, WARMUP_RECIPE, log=log)
    finally:
        torch.set_num_threads(previous_threads)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "mileage_builtin.json").write_text(
        json.dumps({"task": task, **WARMUP_RECIPE, "steps": steps, "accuracy": accuracy})
    )
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first; its weights are identical
        shutil.rmtree(staging, ignore_errors=True)
    log(f"built-in model ready in {time.perf_counter() - started:.0f}s")
    return target
