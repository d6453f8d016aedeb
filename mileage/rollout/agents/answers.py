"""What comes back: an engine completion as the endpoint answers it (cut at the request's stop
sequences, read for tool calls, split into the pieces a stream sends), and what an agent
returned as its sample's reward or the failure that names it."""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable
from typing import Any

from mileage.rollout.agents.protocol import Answer, Request
from mileage.rollout.agents.trajectory import Renderer
from mileage.rollout.engines.base import Completion
from mileage.rollout.sample import AGENT_BAD_RETURN, AGENT_NO_CALLS

MAX_REWARD = 1e6


def make_answer(renderer: Renderer, c: Completion, request: Request, call_prefix: str) -> Answer:
    """The answer to `request` that completion `c` makes. Cut at a stop sequence, it keeps the
    ids up to the one that completed the sequence (their log-probs are unchanged by what was
    sampled after them) and its text ends before the sequence, as OpenAI's does."""
    decode = renderer.tokenizer.decode
    ids, logprobs, finished = list(c.response_ids), list(c.logprobs), c.finished
    text = decode(ids, skip_special_tokens=True)
    if request.stop and any(s in text for s in request.stop):
        for k in range(1, len(ids) + 1):
            part = decode(ids[:k], skip_special_tokens=True)
            hits = [part.find(s) for s in request.stop if s in part]
            if hits:
                ids, logprobs, finished, text = ids[:k], logprobs[:k], True, part[: min(hits)]
                break
    message = renderer.reply(text, request.parse_tools, call_prefix) if request.chat else None
    if not finished:
        finish = "length"  # as OpenAI's: a call cut off by the limit may be incomplete
    elif message is not None and message.get("tool_calls"):
        finish = "tool_calls"
    else:
        finish = "stop"
    tokens = [decode([t]) for t in ids]
    return Answer(text, message, ids, logprobs, tokens, pieces(decode, ids, text), finish)


def pieces(decode: Callable, ids: list[int], text: str) -> list[str]:
    """`text` as one piece per id, in order (a stream's deltas; joined, they are `text`): each
    id's share of the decoded text; an id that ends inside a character, or past a stop
    sequence, adds nothing."""
    pieces, emitted = [], ""
    for k in range(1, len(ids) + 1):
        part = decode(ids[:k], skip_special_tokens=True)[: len(text)]
        if part.endswith("\ufffd") or not part.startswith(emitted) or not text.startswith(part):
            pieces.append("")
            continue
        pieces.append(part[len(emitted) :])
        emitted = part
    if pieces:
        pieces[-1] += text[len(emitted) :]
    return pieces


def judge(result: Any, called: bool) -> tuple[float | None, str | None, Any]:
    """(the agent's own reward or None, the failure's stop reason or None, what names it)."""
    if not called:
        return None, AGENT_NO_CALLS, "never called the endpoint"
    if result is None:
        return None, None, None  # the run's reward scores the trajectory
    number = isinstance(result, numbers.Real) and math.isfinite(float(result))
    if number and abs(float(result)) <= MAX_REWARD:
        return float(result), None, None
    text = repr(result)
    text = text if len(text) <= 40 else text[:37] + "..."
    why = f"returned {text}; expected a finite number (|r| <= 1e6) or None (the run's reward)"
    return None, AGENT_BAD_RETURN, why


def where(exc: BaseException) -> str:
    """The innermost line of the user's own code in `exc`'s traceback."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        name = frame.filename
        if "site-packages" not in name and "/mileage/" not in name and not name.startswith("<"):
            return f" at {name}:{frame.lineno}"
    return ""
