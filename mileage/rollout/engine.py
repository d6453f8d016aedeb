"""The in-process generation engine: batched sampling with a KV cache.

It left-pads prompts, runs one prefill and then one token per step against the cache, samples
with temperature and top-p from a caller-supplied `torch.Generator`, stops rows at EOS and
returns token ids together with the log-probs of the sampled tokens under the generating policy
(temperature-scaled, before top-p truncation — the same distribution the trainer scores).
Remote engines (vLLM/SGLang servers) implement the same `generate`/`update_weights` pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


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


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (tokens, log-probs of those tokens)."""
    logits = logits.float()
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class LocalEngine:
    """Generates with a `transformers` causal LM held in this process."""

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int, max_batch_size: int = 256):
        self.model = model
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size

    def update_weights(self, model: torch.nn.Module) -> None:
        """The in-process engine shares the trainer's module, so new weights are already live."""
        self.model = model

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        results: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            results += self._generate_batch(
                prompts[start : start + self.max_batch_size], params, generator
            )
        return results

    @torch.inference_mode()
    def _generate_batch(self, prompts, params, generator) -> list[Completion]:
        device = next(self.model.parameters()).device
        batch, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
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
        next_pos = positions[:, -1:] + 1
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        tokens_out, logprobs_out = [], []
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_tokens(out.logits[:, -1], params, generator)
            tokens = tokens.masked_fill(done, self.pad_id)
            tokens_out.append(tokens)
            logprobs_out.append(logprobs)
            done = done | (tokens == self.eos_id)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                cache=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
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
                )
            )
        return completions
