"""The OpenAI API's request and reply shapes, the subset an agent uses: every field checked
once, here, before the endpoint acts on it.

A request the endpoint cannot take is answered with OpenAI's error shape,
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`, and HTTP 400 (401
for an unknown key, 404 for an unknown path, 409 for a sample that has ended, 413 for a body
over the limit). Sampling is the run's: `temperature`, `top_p` and `seed` are checked and
ignored, since the trainer's log-probs are those of the run's sampling (docs/agents.md).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from mileage.rollout.agents.trajectory import RenderError, content_text

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16  # answers per request at most
MAX_STOP = 4  # stop sequences per request at most (OpenAI's limit)
MAX_BODY_BYTES = 16 << 20


class ApiError(ValueError):
    """A request the endpoint refuses (HTTP `status`, the request field `param`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = {
            401: "authentication_error",
            404: "not_found_error",
            409: "conflict_error",
            413: "request_too_large",
        }
        return {
            "error": {
                "message": str(self),
                "type": kind.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": None,
            }
        }


@dataclass(frozen=True)
class Request:
    """A checked /v1/chat/completions or /v1/completions request."""

    chat: bool
    messages: list[dict[str, Any]] | None  # chat
    tools: list[dict[str, Any]] | None
    parse_tools: bool  # tool_choice is not "none" and tools were given
    prompt: str | list[int] | None  # completions
    n: int
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    echo_ids: bool  # vLLM's return_token_ids: the prompt's and each answer's ids in the reply
    model: str


def _int(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ApiError(f"{key} must be an integer >= {low}, got {value!r}", param=key)
    if high is not None and value > high:
        raise ApiError(f"{key} must be at most {high}, got {value}", param=key)
    return value


def _number(body: dict, key: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(f"{key} must be a finite number, got {value!r}", param=key)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be true or false, got {value!r}", param=key)
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list of messages", param="messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(
                f"messages[{i}] must be an object with a role among {', '.join(ROLES)}",
                param="messages",
            )
        try:
            content_text(m.get("content"))
        except RenderError as exc:
            raise ApiError(f"messages[{i}]: {exc}", param="messages") from None
        for call in m.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ApiError(
                    f"messages[{i}].tool_calls: each call needs function.name", param="messages"
                )
    if value[-1]["role"] == "assistant":
        raise ApiError(
            "the last message is the assistant's; this endpoint answers as the assistant "
            "after the conversation (continuing a prefilled answer is not supported)",
            param="messages",
        )
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("stop must be a string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP:
        raise ApiError(f"stop takes at most {MAX_STOP} sequences", param="stop")
    return tuple(stops)


def parse_request(raw: bytes, chat: bool) -> Request:
    """The request in `raw` (a JSON body), checked."""
    try:
        body = json.loads(raw.decode("utf-8")) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"the body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ApiError("model must be a string", param="model")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _number(body, key)
    _int(body, "seed", -(1 << 63))
    n = _int(body, "n", 1, MAX_N) or 1
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    if _int(body, "top_logprobs", 0) or (not chat and _int(body, "logprobs", 0)):
        raise ApiError(
            "top_logprobs: the engine returns the sampled token's log-prob only",
            param="top_logprobs",
        )
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    messages = prompt = None
    tools = None
    parse_tools = False
    if chat:
        messages = _messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
        ):
            raise ApiError("tools must be a list of tool objects", param="tools")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise ApiError(
                "tool_choice: only 'auto' and 'none' (the model decides whether to call; "
                "the run does not force its sampling)",
                param="tool_choice",
            )
        parse_tools = choice != "none"
        logprobs = _bool(body, "logprobs")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one prompt
        ok_ids = (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        )
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise ApiError(
                "prompt must be one non-empty string or one list of token ids", param="prompt"
            )
        logprobs = body.get("logprobs") is not None
        if body.get("echo"):
            raise ApiError("echo is not supported", param="echo")
    return Request(
        chat=chat,
        messages=messages,
        tools=tools or None,
        parse_tools=parse_tools,
        prompt=prompt,
        n=n,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=_bool(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
        logprobs=logprobs,
        echo_ids=_bool(body, "return_token_ids"),
        model=model,
    )


@dataclass
class Answer:
    """One choice as the endpoint returns it."""

    text: str
    message: dict[str, Any] | None  # chat: the assistant message
    ids: list[int]
    logprobs: list[float]
    tokens: list[str]  # each id's own text (the log-probs' tokens)
    pieces: list[str]  # the text, one piece per id (what a stream sends; joined: `text`)
    finish_reason: str  # "stop", "length" or "tool_calls"


def _logprobs(answer: Answer, chat: bool) -> dict[str, Any]:
    if chat:
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode("utf-8")),
                    "top_logprobs": [],
                }
                for t, lp in zip(answer.tokens, answer.logprobs, strict=True)
            ]
        }
    offsets, at = [], 0
    for t in answer.tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": answer.tokens,
        "token_logprobs": answer.logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def reply(
    request: Request, answers: list[Answer], prompt_ids: list[int], ident: str
) -> dict[str, Any]:
    """The whole (non-streaming) reply."""
    choices = []
    for i, a in enumerate(answers):
        choice: dict[str, Any] = {"index": i, "finish_reason": a.finish_reason}
        if request.chat:
            choice["message"] = a.message
        else:
            choice["text"] = a.text
        choice["logprobs"] = _logprobs(a, request.chat) if request.logprobs else None
        if request.echo_ids:
            choice["token_ids"] = a.ids
        choices.append(choice)
    out = {
        "id": ident,
        "object": "chat.completion" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": usage(prompt_ids, answers),
    }
    if request.echo_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


def usage(prompt_ids: list[int], answers: list[Answer]) -> dict[str, int]:
    completion = sum(len(a.ids) for a in answers)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def chunks(
    request: Request, answers: list[Answer], prompt_ids: list[int], ident: str
) -> list[dict[str, Any]]:
    """The reply as stream events: per choice its role, its text token by token, its tool calls,
    then its finish reason; the usage last when asked for."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    created = int(time.time())
    events = []

    def event(choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": ident,
            "object": kind,
            "created": created,
            "model": request.model,
            "choices": [choice],
        }

    for i, a in enumerate(answers):
        if not request.chat:
            for text, token, lp in zip(a.pieces, a.tokens, a.logprobs, strict=True):
                piece = {"index": i, "text": text, "finish_reason": None}
                if request.logprobs:
                    piece["logprobs"] = {"tokens": [token], "token_logprobs": [lp]}
                events.append(event(piece))
            events.append(event({"index": i, "text": "", "finish_reason": a.finish_reason}))
            continue
        assert a.message is not None
        events.append(event({"index": i, "delta": {"role": "assistant", "content": ""}}))
        if a.message.get("content"):
            pieces = a.pieces if not a.message.get("tool_calls") else [a.message["content"]]
            for piece in pieces:
                if piece:
                    events.append(event({"index": i, "delta": {"content": piece}}))
        for k, call in enumerate(a.message.get("tool_calls") or []):
            events.append(event({"index": i, "delta": {"tool_calls": [{"index": k, **call}]}}))
        events.append(event({"index": i, "delta": {}, "finish_reason": a.finish_reason}))
    if request.include_usage:
        tail = event({})
        tail["choices"] = []
        tail["usage"] = usage(prompt_ids, answers)
        events.append(tail)
    return events


def models(name: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "mileage"}],
    }
