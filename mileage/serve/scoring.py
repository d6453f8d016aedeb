"""SGLang's prefill-only `/generate`: the log-prob of every given token, nothing generated.

A request with `"return_logprob": true`, `"logprob_start_len": S` and
`"sampling_params": {"max_new_tokens": 0}` asks for the log-probs of its own input tokens from
position S on, as SGLang answers it in `meta_info.input_token_logprobs`: `[log-prob, token id,
null]` per token, the first token's log-prob null (nothing precedes it). This is how an
on-policy-distillation teacher scores a student's sampled tokens (slime's
`on_policy_distillation.reward_func` sends the same request). Log-probs are at the request's
temperature (SGLang's default 1; 0 counts as 1: there is no greedy distribution to score
under), computed in fp32 from the served model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mileage.serve.requests import RequestError, _is_int, _number, _show, _token_rows


@dataclass(frozen=True)
class ScoringRequest:
    rows: list[list[int]]
    single: bool
    start: int  # logprob_start_len
    temperature: float


def parse_scoring(body: dict, vocab_size: int) -> ScoringRequest | None:
    """The request as a scoring one, or None when it asks to generate (max_new_tokens > 0)."""
    sampling = body.get("sampling_params") or {}
    if isinstance(sampling, list):
        sampling = sampling[0] if sampling else {}
    if not isinstance(sampling, dict) or sampling.get("max_new_tokens") != 0:
        return None
    if body.get("return_logprob") is not True:
        raise RequestError("max_new_tokens 0 scores the input: it needs return_logprob true")
    if body.get("input_ids") is None:
        raise RequestError("input_ids: mileage serve takes token ids, not text")
    rows, single = _token_rows(body["input_ids"], vocab_size)
    start = body.get("logprob_start_len", 0)
    if not (_is_int(start) and start >= 0):
        raise RequestError(f"logprob_start_len: expected an integer >= 0, got {_show(start)}")
    temperature = _number(sampling, "temperature", "sampling_params")
    if temperature < 0:
        raise RequestError(f"sampling_params.temperature: expected 0 or more, got {temperature}")
    return ScoringRequest(rows, single, start, temperature or 1.0)


@torch.no_grad()
def score_rows(model: torch.nn.Module, request: ScoringRequest) -> list[dict]:
    """One reply per row, as SGLang shapes it. Rows run one at a time: a row's log-probs never
    depend on what else the request holds."""
    device = next(model.parameters()).device
    outputs = []
    for row in request.rows:
        ids = torch.tensor([row], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float() / request.temperature
        picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
        values = [None, *picked.tolist()]
        outputs.append(
            {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "input_token_logprobs": [
                        [lp, token, None] for lp, token in zip(values, row, strict=True)
                    ][request.start :],
                    "prompt_tokens": len(row),
                    "completion_tokens": 0,
                    "finish_reason": {"type": "length", "length": 0},
                },
            }
        )
    return outputs
