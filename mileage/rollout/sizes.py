"""Sizes checked against the model and the machine before anything heavy starts.

A response length past the model's context, or a rollout whose samples cannot fit in memory,
otherwise ends minutes later in an allocation failure (a KV cache of terabytes) or in a machine
that swaps to a halt. Each check here is cheap: it reads the model config and counts; prompt
token counts are computed only for prompts long enough (in UTF-8 bytes) to possibly matter.

The memory checks refuse only what cannot fit: they count a lower bound of what the run must
hold (the preallocated KV cache of one generation batch; the sampled tokens of one rollout)
against the device's total memory, so a run refused here could never have finished.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from mileage.errors import UserError
from mileage.rollout.engine import GENERATION_BATCH

# the config keys under which architectures record their context length
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# a prompt's token count never exceeds its UTF-8 byte count plus the tokens its template adds
# (byte-level BPE, SentencePiece with byte fallback and char tokenizers all emit >= 1 byte per
# token); this slack covers merges that differ where the text meets the template
TEMPLATE_SLACK = 8
# at least this much memory per token of every sample of a rollout: the token id and log-prob as
# Python objects in the sample lists (36 + 32 bytes) and the int64 ids + fp32 log-probs, mask and
# advantages of the packed batch; a lower bound, so only rollouts that cannot fit are refused
BYTES_PER_SAMPLE_TOKEN = 48


def context_length(config: Mapping) -> int | None:
    """The model's maximum sequence length, or None when its config does not say."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def kv_cache_bytes(config: Mapping, rows: int, length: int, dtype_bytes: int = 4) -> int:
    """The key/value cache of `rows` sequences of `length` tokens (what the engine preallocates)."""
    layers = int(config.get("num_hidden_layers") or config.get("n_layer") or 0)
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return 2 * layers * kv_heads * head_dim * rows * length * dtype_bytes


def memory_bytes(device: torch.device) -> int:
    """Total memory of `device`: the GPU's, or the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def prompt_over(
    texts: list[str], encode: Callable[[str], list[int]], limit: int
) -> tuple[int, int] | None:
    """(index, token count) of a prompt of more than `limit` tokens (the longest in bytes of
    those that are), or None. Only prompts whose byte count allows it are encoded."""
    overhead = len(encode("")) + TEMPLATE_SLACK
    nbytes = [len(t.encode()) for t in texts]
    candidates = sorted(
        (i for i, n in enumerate(nbytes) if n + overhead > limit), key=lambda i: -nbytes[i]
    )
    for index in candidates:
        count = len(encode(texts[index]))
        if count > limit:
            return index, count
    return None


def length_problem(
    config: Mapping, prompt_len: int, max_new_tokens: int, response_flag: str, prompt: str = ""
) -> str | None:
    """Why a prompt of `prompt_len` tokens (described as `prompt`, if given) plus
    `max_new_tokens` does not fit the model's context."""
    context = context_length(config)
    if context is None:
        return None
    key = next(k for k in CONTEXT_KEYS if config.get(k) == context)
    where = f"the model's context of {context} tokens ({key} in its config)"
    if max_new_tokens >= context:
        return f"{response_flag} {max_new_tokens} does not fit {where}"
    if prompt_len + max_new_tokens > context:
        prompt = prompt or "a prompt"
        return (
            f"{prompt} of {prompt_len} tokens plus {response_flag} {max_new_tokens} is "
            f"{prompt_len + max_new_tokens} tokens, more than {where}"
        )
    return None


def kv_cache_problem(
    config: Mapping, rows: int, length: int, device: torch.device, dtype_bytes: int = 4
) -> str | None:
    """Why one generation batch's KV cache cannot fit on `device`."""
    need, have = kv_cache_bytes(config, rows, length, dtype_bytes), memory_bytes(device)
    if need <= have:
        return None
    return (
        f"generating {rows} sequences of up to {length} tokens at once needs a "
        f"{gib(need)} KV cache, more than the {gib(have)} of the {device.type}"
    )


def check_rollout_sizes(
    config: Mapping,
    encode: Callable[[str], list[int]],
    train_texts: list[str],
    eval_texts: list[str],
    batch: int,
    n_samples: int,
    max_new_tokens: int,
    engine_device: torch.device | None,
) -> None:
    """Refuse, in one line, a rollout that cannot run on this model, data and machine.

    `engine_device` is where the in-process engine generates (None: a remote engine, whose
    memory is its own server's).
    """
    if batch > len(train_texts):
        # PromptSource would wrap into the next epoch within the batch: the same prompt twice in
        # one rollout, its samples in two groups that advantages treat as different prompts
        raise UserError(
            f"--rollout-batch-size {batch} is more than the {len(train_texts)} prompts of the "
            f"training data (a rollout would sample the same prompt twice); use at most "
            f"{len(train_texts)}"
        )
    flag = "--rollout-max-response-len"
    problem = length_problem(config, 0, max_new_tokens, flag)
    if problem:
        raise UserError(problem)
    context = context_length(config)
    if context is not None:
        for name, texts in (("training", train_texts), ("evaluation", eval_texts)):
            over = prompt_over(texts, encode, context - max_new_tokens)
            if over:
                index, count = over
                raise UserError(
                    length_problem(config, count, max_new_tokens, flag, f"{name} prompt {index}")
                )
    samples, tokens = batch * n_samples, max_new_tokens + 1
    if engine_device is not None:
        # the first allocation of a rollout, so the first to check
        rows = min(samples, GENERATION_BATCH)
        problem = kv_cache_problem(config, rows, tokens, engine_device)
        if problem:
            raise UserError(f"{problem}; lower {flag} or --n-samples-per-prompt")
    need, have = samples * tokens * BYTES_PER_SAMPLE_TOKEN, memory_bytes(torch.device("cpu"))
    if need > have:
        raise UserError(
            f"--rollout-batch-size {batch} x --n-samples-per-prompt {n_samples} = {samples} "
            f"samples of up to {tokens} tokens need about {gib(need)} of memory per rollout, "
            f"more than this machine's {gib(have)}"
        )


def samples_memory_problem(samples: int, tokens: int, what: str) -> str | None:
    """Why `samples` sampled answers of up to `tokens` tokens each (described by `what`, the
    flags that make them) cannot be held in this machine's memory at once."""
    need, have = samples * tokens * BYTES_PER_SAMPLE_TOKEN, memory_bytes(torch.device("cpu"))
    if need <= have:
        return None
    return (
        f"{what} = {samples} samples of up to {tokens} tokens need about {gib(need)} of memory, "
        f"more than this machine's {gib(have)}"
    )


def check_eval_memory(largest_set: int, n_samples: int, max_new_tokens: int) -> None:
    """Refuse an evaluation whose answers to its largest dataset cannot fit in memory (they are
    held all at once, to compute pass@k)."""
    what = f"--n-samples-per-eval-prompt {n_samples} x the {largest_set} prompts of a dataset"
    problem = samples_memory_problem(largest_set * n_samples, max_new_tokens + 1, what)
    if problem:
        raise UserError(problem)


def check_round_memory(round_size: int, n_samples: int, max_new_tokens: int) -> None:
    """Refuse a dynamic-sampling round (--over-sampling-batch-size prompts) that cannot fit."""
    what = f"--over-sampling-batch-size {round_size} x --n-samples-per-prompt {n_samples}"
    problem = samples_memory_problem(round_size * n_samples, max_new_tokens + 1, what)
    if problem:
        raise UserError(problem)


# more torch threads than this many per CPU only wait on each other (docs/benchmarks.md: two
# processes of 2 threads on 2 cores ran 10-40x slower), and OpenMP cannot start tens of
# thousands of them at all: `--num-threads 100000` crashed the process (a segfault) instead of
# failing; a few per CPU are left for a run resumed on a smaller machine with its thread count
THREADS_PER_CPU = 4


def check_thread_count(num_threads: int, flag: str = "--num-threads") -> None:
    cpus = os.cpu_count() or 1
    limit = THREADS_PER_CPU * cpus
    if num_threads > limit:
        raise UserError(
            f"{flag} {num_threads} is more than {THREADS_PER_CPU} threads per CPU of this "
            f"machine's {cpus} ({limit}): more only wait on each other, and thousands cannot "
            "be started at all"
        )


def check_lora_rank(config: Mapping, rank: int) -> None:
    """Refuse a LoRA rank above the model's hidden size: the update B @ A of an adapted d x k
    weight has rank at most min(d, k) <= hidden_size, so a larger rank adds parameters (r x (d +
    k) per weight, more than the weight itself) and memory without adding anything."""
    hidden = config.get("hidden_size") or config.get("n_embd")
    if isinstance(hidden, int) and rank > hidden:
        raise UserError(
            f"--lora-rank {rank} is more than the model's hidden_size {hidden} (its config): an "
            "adapter cannot have a rank above the smaller side of the weight it adapts; use at "
            f"most {hidden}"
        )
