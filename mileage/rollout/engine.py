"""The in-process generation engine: batched sampling with a KV cache.

It left-pads prompts, runs one prefill and then one token per step against the cache, samples
with temperature and top-p from a caller-supplied `torch.Generator`, stops rows at EOS and
returns token ids together with the log-probs of the sampled tokens under the generating policy
(temperature-scaled, before top-p truncation — the same distribution the trainer scores).
Remote engines (vLLM/SGLang servers, `mileage.rollout.engines`) implement the same interface
(`mileage.rollout.engines.base.Engine`).

Decoding Llama-family models (Llama, Mistral, Qwen2 with SDPA attention) takes a fast path: the
prefill still runs through the `transformers` model, but each new token runs through
`FastDecoder` (`fast_decode.py`), which repeats the model's arithmetic op for op against a preallocated KV cache.
Its tokens and log-probs are bit-identical to stepping the `transformers` model; it only skips
what costs time there (regrowing the cache by concatenation every step, rebuilding masks and
rotary tables, generic per-call Python). Other models decode through the `transformers` forward.

Samples of the same prompt (GRPO's n per prompt) share one prefill row, copied into each
sample's cache before the first decode step. In fp32 on a CPU the linears multiply by weights
reordered once per batch for oneDNN (`mileage.models.packed`).

Generation runs in the model's precision (`mileage.precision`): under bf16 autocast the prefill
and both decode paths round the same operands the same way, so the fast path stays bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mileage.models.kv_cache import expand_rows
from mileage.models.packed import use_packed_linears
from mileage.precision import generation_autocast
from mileage.rollout.fast_decode import FastDecoder

# top-p first looks for the nucleus among this many most likely tokens
TOP_P_CANDIDATES = 1024
# vocabularies larger than this are sampled block-wise (see _draw_categorical)
CDF_BLOCK = 1024
# rows generated at once (one KV cache); longer lists of prompts are generated in such batches
GENERATION_BATCH = 256


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with EOS rather than by the length limit
    weight_version: int = 0  # the trainer's optimizer step whose weights generated it


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds `target` [R, 1].

    The target is clamped just below the row total, so some entry always exceeds it (u * total
    can round up to the total), and the index found always has a positive weight.
    """
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)


def _uniforms(
    rows: int, generator: torch.Generator | list[torch.Generator] | None, device: torch.device
) -> torch.Tensor:
    """One float64 uniform per row [R, 1]: all from `generator`, or row i from `generator[i]`.

    A generator per row makes each row's sample a function of its own seed only, whatever
    else is batched with it (`mileage serve` seeds each row of a request this way).
    """
    if isinstance(generator, list):
        draws = [
            torch.rand((1, 1), generator=g, dtype=torch.float64, device=g.device) for g in generator
        ]
        return torch.cat([d.to(device) for d in draws])
    source = generator.device if generator is not None else device
    return torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=source).to(device)


def _draw_categorical(
    probs: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None
) -> torch.Tensor:
    """One index per row of `probs` [B, V] (non-negative, any positive total), by inverse CDF.

    One uniform draw per row, where `torch.multinomial` draws V exponentials per row (for a 49k
    vocabulary that was a quarter of a CPU decode step). Large vocabularies are searched in two
    levels, blocks and then one block, so no full-length cumulative sum is built. The uniforms
    come from `generator`'s own device: a CPU generator gives the same draws on any device.
    """
    rows, vocab = probs.shape
    u = _uniforms(rows, generator, probs.device)
    if vocab <= CDF_BLOCK:
        cdf = probs.double().cumsum(-1)
        return _search(cdf, u * cdf[:, -1:]).squeeze(-1)
    pad = -vocab % CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(-1).double().cumsum(-1)
    target = u * block_cdf[:, -1:]
    block = _search(block_cdf, target)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, block[..., None].expand(-1, -1, CDF_BLOCK)).squeeze(1)
    # target - before >= 0 by the search; rounding past the block's own total is clamped
    index = _search(inner.double().cumsum(-1), target - before)
    return (block * CDF_BLOCK + index).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | list[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (tokens, log-probs of those tokens)."""
    logits = logits.float()
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    if params.temperature != 1.0:  # x / 1.0 == x exactly, so skipping it changes no bits
        logits = logits / params.temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        # the nucleus nearly always lies within the most likely few hundred tokens, and a top-k
        # is far cheaper than sorting a 49k vocabulary; sort everything only when it does not
        sorted_probs, order = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)
        mass = sorted_probs.cumsum(-1)
        if mass.shape[-1] < probs.shape[-1] and bool((mass[:, -1] < params.top_p).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = mass - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        tokens = order.gather(-1, _draw_categorical(sorted_probs, generator)[:, None]).squeeze(-1)
    else:
        tokens = _draw_categorical(probs, generator)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class LocalEngine:
    """Generates with a `transformers` causal LM held in this process."""

    # its log-probs come from the trainer's own module: recomputing them would repeat the work
    in_process = True

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        eos_id: int,
        max_batch_size: int = GENERATION_BATCH,
    ):
        self.model = model
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size
        self.weight_version = 0

    def update_weights(self, model: torch.nn.Module, version: int = 0) -> None:
        """The in-process engine shares the trainer's module, so new weights are already live."""
        self.model = model
        self.weight_version = version

    def close(self) -> None:
        """Nothing to release: the module belongs to the trainer."""

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed=None,
        group_size: int = 1,
    ) -> list[Completion]:
        """Completions of `prompts`; `seed` is a `SamplingSeed` (one generator for the whole
        call, `generator_for(seed, "rollout", rollout_id)`), a torch.Generator, a list of one
        generator per prompt, or None. `group_size` only matters to remote engines."""
        generator = seed.generator() if hasattr(seed, "generator") else seed
        results: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            stop = start + self.max_batch_size
            part = generator[start:stop] if isinstance(generator, list) else generator
            results += self._generate_batch(prompts[start:stop], params, part)
        return results

    def _generate_batch(self, prompts, params, generator) -> list[Completion]:
        # Prefill and every decode step (the fast path too) run in the model's precision, in one
        # autocast context so that each fp32 weight is rounded to bf16 once per batch, not once
        # per token. Under no_grad, not inference_mode: autocast caches those casts only outside
        # inference mode (in it, SmolLM2 bf16 spent 39 % of generation copying weights).
        # every batch: modules added since (a served LoRA adapter) multiply as the rest do
        use_packed_linears(self.model)
        with torch.no_grad(), generation_autocast(self.model):
            return self._generate_batch_in_precision(prompts, params, generator)

    def _generate_batch_in_precision(self, prompts, params, generator) -> list[Completion]:
        device = next(self.model.parameters()).device
        batch = len(prompts)
        # GRPO sends each prompt n times, and their prefill rows would be the same: each distinct
        # prompt is prefilled once and its cache row copied to its samples
        first_row: dict[tuple[int, ...], int] = {}
        row_of = [first_row.setdefault(tuple(p), len(first_row)) for p in prompts]
        distinct = list(first_row)
        width = max(len(p) for p in distinct)
        ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, prompt in enumerate(distinct):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
        del out
        if len(distinct) < batch:
            rows = torch.tensor(row_of, device=device)
            expand_rows(cache, rows)
            logits, mask, positions = logits[rows], mask[rows], positions[rows]
        steps = params.max_new_tokens
        if FastDecoder.supports(self.model, width + steps):
            decode = self._fast_steps(cache, mask, positions, steps)
        else:
            decode = self._model_steps(cache, mask, positions)
        del cache
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        tokens_out, logprobs_out = [], []
        for step in range(steps):
            tokens, logprobs = sample_tokens(logits, params, generator)
            tokens = tokens.masked_fill(done, self.pad_id)
            tokens_out.append(tokens)
            logprobs_out.append(logprobs)
            done = done | (tokens == self.eos_id)
            if bool(done.all()) or step == steps - 1:
                break
            logits = decode(tokens, step)
        all_tokens = torch.stack(tokens_out, dim=1).cpu()
        all_logprobs = torch.stack(logprobs_out, dim=1).float().cpu()
        completions = []
        for row, prompt in enumerate(prompts):
            row_tokens = all_tokens[row].tolist()
            length = (
                row_tokens.index(self.eos_id) + 1 if self.eos_id in row_tokens else len(row_tokens)
            )
            completions.append(
                Completion(
                    prompt_ids=list(prompt),
                    response_ids=row_tokens[:length],
                    logprobs=all_logprobs[row, :length].tolist(),
                    finished=self.eos_id in row_tokens,
                    weight_version=self.weight_version,
                )
            )
        return completions

    def _model_steps(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor):
        """Decode step through the `transformers` forward (any architecture)."""
        state = {"mask": mask, "pos": positions[:, -1:] + 1}

        def decode(tokens: torch.Tensor, step: int) -> torch.Tensor:
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones((len(tokens), 1))], 1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=state["mask"],
                position_ids=state["pos"],
                cache=cache,
                use_cache=True,
            )
            state["pos"] = state["pos"] + 1
            return out.logits[:, -1]

        return decode

    def _fast_steps(
        self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor, steps: int
    ):
        """Decode step through `FastDecoder`, with the per-step tables built once up front."""
        batch, width = mask.shape
        decoder = FastDecoder(self.model, batch, width + steps)
        decoder.load_prefill(cache, width)
        # transformers drops the mask entirely when nothing is padded; so must we (other kernel)
        pad_mask = None
        if not bool(mask.all()):
            pad_mask = torch.ones(
                (batch, 1, 1, width + steps), dtype=torch.bool, device=mask.device
            )
            pad_mask[:, 0, 0, :width] = mask.bool()
        # rotary tables for every decode position at once; the rotary module is elementwise in
        # the position, so this equals computing them step by step
        new_positions = positions[:, -1:] + 1 + torch.arange(steps, device=mask.device)
        cos, sin = self.model.model.rotary_emb(decoder.embed, new_positions)
        half = decoder.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, sin = cos[:, :, None, None, :], sin[:, :, None, None, :]  # [B, steps, 1, 1, D]

        def decode(tokens: torch.Tensor, step: int) -> torch.Tensor:
            index = width + step
            step_mask = None if pad_mask is None else pad_mask[..., : index + 1]
            return decoder.step(tokens, index, cos[:, step], sin[:, step], step_mask)

        return decode
