"""One sample's trajectory as its agent builds it through the endpoint, token in and token out.

The agent sends text (chat messages, or a completion prompt); the model sampled token ids. A
trajectory never turns the model's own text back into ids: when a request holds the history so
far (the last request's messages, then one of the replies it got, then new messages), the ids
of that history are the ones already recorded, and only the new messages are rendered, as the
chat template appends them (`multiturn.appended_ids`), or as plain text for a tokenizer without
a template (the built-in model: the tool format's own rendering, as the built-in tool loop
writes it). So the trained ids are the engine's ids exactly, whatever the agent's framework did
to the text in between.

A request that does not continue the history (the agent summarised, truncated or rewrote it,
or the template renders the history differently once more follows) starts a new segment from
the request's own rendering: a split, counted in the sample's `agent_stats`. The sample trains
its last segment, which holds the final answer the reward reads; the model tokens of earlier
segments are counted as `untrained_tokens` (the trainer's batches have one row per sample).

A request equal to the previous one (a retry, or asking again for another answer) samples again
from the same context: no split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mileage.rollout.multiturn import appended_ids
from mileage.rollout.tool_parsers import ToolCallError, ToolFormat

CHAT = "chat"
TEXT = "completions"


class RenderError(ValueError):
    """A request whose messages cannot be turned into ids (HTTP 400)."""


def content_text(content: Any) -> str:
    """A message's content as text: a string, None (""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RenderError(f"messages: content part of type {kind!r}; only text parts")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RenderError(f"messages: content must be a string or a list of parts, got {content!r}")


def _arguments(value: Any) -> Any:
    """A tool call's arguments as an object (the JSON string an OpenAI client sends, parsed)."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
    return value


def render_form(message: dict[str, Any]) -> dict[str, Any]:
    """The message as a chat template takes it: text content, call arguments as objects."""
    out: dict[str, Any] = {"role": message["role"], "content": content_text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": c.get("id", f"call_{i}"),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments", {})),
                },
            }
            for i, c in enumerate(calls)
        ]
    for key in ("tool_call_id", "name"):
        if key in message and message[key] is not None:
            out[key] = message[key]
    return out


def identity(message: dict[str, Any]) -> tuple:
    """What makes two messages the same turn of a history: role, text and the calls (name and
    arguments); not the call ids or the fields a client adds (refusal, annotations, ...)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
        for c in message.get("tool_calls") or []
    )
    return (message["role"], content_text(message.get("content")), calls)


@dataclass
class Candidate:
    """One answer of the trajectory's last call (a request with n > 1 has several)."""

    ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool
    message: dict[str, Any]  # the assistant message returned (chat), in render form
    text: str  # the text returned


@dataclass
class Segment:
    """Ids the model saw as one context: the rendering it began with, then every token after."""

    kind: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    asked: Any = None  # the last request: message identities (chat) or prompt (completions)
    asked_messages: list[dict[str, Any]] = field(default_factory=list)  # its render forms
    tools: list[dict[str, Any]] | None = None

    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def model_tokens(self) -> int:
        return sum(self.mask)


@dataclass
class Plan:
    """How a request's input ids come about (nothing is changed until its answers arrive)."""

    input_ids: list[int]
    segment: Segment | None  # the segment continued; None: a new one starts
    candidate: int | None  # which of the last answers the request continues
    appended: list[int]  # ids after that answer (new messages; mask 0)
    asked: Any
    asked_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kind: str


class Renderer:
    """Messages and prompts to ids, with the chat template or as plain text."""

    def __init__(self, tokenizer: Any, tool_format: ToolFormat):
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.template = bool(getattr(tokenizer, "chat_template", None))

    def text_ids(self, text: str, first: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """A conversation's ids, ready for the assistant's next turn."""
        if self.template:
            extra = {"tools": tools} if tools else {}
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
                )
            )
        return self.plain(messages, first=True)

    def plain(self, messages: list[dict[str, Any]], first: bool) -> list[int]:
        """Without a template: system and user text as it is (the built-in task's prompt),
        tool outputs as the tool format writes them, an assistant's text then end-of-sequence."""
        ids: list[int] = []
        text, tool_outputs = "", []

        def flush() -> None:
            nonlocal text, tool_outputs
            if tool_outputs:
                text += self.tool_format.render(tool_outputs)
                tool_outputs = []
            if text:
                ids.extend(self.text_ids(text, first and not ids))
                text = ""

        for m in messages:
            if m["role"] == "tool":
                tool_outputs.append(m["content"])
                continue
            if tool_outputs:
                flush()
            if m["role"] == "assistant":
                flush()
                if m.get("tool_calls"):
                    raise RenderError(
                        "messages: an assistant tool call this endpoint did not write, for a "
                        "tokenizer without a chat template (its text cannot be rebuilt)"
                    )
                ids.extend(self.text_ids(m["content"], first and not ids))
                ids.append(self.tokenizer.eos_token_id)
            else:
                text += m["content"]
        flush()
        return ids

    def continuation(
        self,
        history: list[dict[str, Any]],
        new: list[dict[str, Any]],
        last_ids: list[int],
        tools: list[dict] | None,
    ) -> list[int] | None:
        """The ids `new` messages append after `history` (ending with the model's answer whose
        ids end with `last_ids`); None when the template cannot append them."""
        if self.template:
            return appended_ids(self.tokenizer, history, new, last_ids, tools)
        try:
            return self.plain(new, first=False)
        except RenderError:
            return None

    def reply(self, text: str, parse_tools: bool, call_prefix: str) -> dict[str, Any]:
        """The assistant message an answer's text makes: tool calls read by the run's parser,
        in OpenAI's `tool_calls` form."""
        calls = []
        if parse_tools:
            try:
                calls = self.tool_format.parse(text)
            except ToolCallError:
                calls = []  # the agent gets the text as it is
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            content = self.tool_format.content(text)
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": f"{call_prefix}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for i, c in enumerate(calls)
            ]
        return message


class Trajectory:
    """The segments of one sample and the answers of its last call (module docstring)."""

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        self.segments: list[Segment] = []
        self.candidates: list[Candidate] = []
        self.splits = 0
        self.calls = 0  # engine rows requested so far (each keys its seed and journal entry)
        self.requests = 0
        self.last_finished = False  # the trained answer ended by itself (not its token limit)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def plan_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> Plan:
        forms = [render_form(m) for m in messages]
        asked = [identity(m) for m in forms]
        seg = self.current
        if seg is not None and seg.kind == CHAT and seg.tools == tools:
            if asked == seg.asked:  # asked again: sample again from the same context
                return Plan(seg.context(), seg, None, [], asked, forms, tools, CHAT)
            for k, cand in enumerate(self.candidates):
                prefix = [*seg.asked, identity(cand.message)]
                if len(asked) > len(prefix) and asked[: len(prefix)] == prefix:
                    history = [*seg.asked_messages, render_form(cand.message)]
                    new = forms[len(prefix) :]
                    appended = self.renderer.continuation(history, new, cand.ids, tools)
                    if appended is not None:
                        ids = seg.context() + cand.ids + appended
                        return Plan(ids, seg, k, appended, asked, forms, tools, CHAT)
        ids = self.renderer.chat(forms, tools)
        return Plan(ids, None, None, [], asked, forms, tools, CHAT)

    def plan_text(self, prompt: str | list[int]) -> Plan:
        seg = self.current
        if seg is not None and seg.kind == TEXT:
            if prompt == seg.asked:
                return Plan(seg.context(), seg, None, [], prompt, [], None, TEXT)
            for k, cand in enumerate(self.candidates):
                if isinstance(prompt, str) and isinstance(seg.asked, str):
                    before = seg.asked + cand.text
                    if prompt.startswith(before):
                        rest = prompt[len(before) :]
                        appended = self.renderer.text_ids(rest, False) if rest else []
                        ids = seg.context() + cand.ids + appended
                        return Plan(ids, seg, k, appended, prompt, [], None, TEXT)
                elif isinstance(prompt, list):
                    before_ids = seg.context() + cand.ids
                    if prompt[: len(before_ids)] == before_ids:
                        appended = prompt[len(before_ids) :]
                        return Plan(list(prompt), seg, k, appended, prompt, [], None, TEXT)
        ids = list(prompt) if isinstance(prompt, list) else self.renderer.text_ids(prompt, True)
        return Plan(ids, None, None, [], prompt, [], None, TEXT)

    def commit(self, plan: Plan, candidates: list[Candidate]) -> None:
        """The request was answered with `candidates`: the plan becomes the trajectory."""
        self.requests += 1
        if plan.segment is None:
            if self.segments:
                self.splits += 1
                if self.candidates:  # what the old segment ended on, for its count
                    self._take(self.segments[-1], self.candidates[0])
            seg = Segment(plan.kind, list(plan.input_ids), tools=plan.tools)
            self.segments.append(seg)
        else:
            seg = plan.segment
            if plan.candidate is not None:
                self._take(seg, self.candidates[plan.candidate])
                version = self.candidates[plan.candidate].version
                seg.response_ids += plan.appended
                seg.mask += [0] * len(plan.appended)
                seg.logprobs += [0.0] * len(plan.appended)
                seg.versions += [version] * len(plan.appended)
        seg.asked, seg.asked_messages = plan.asked, plan.asked_messages
        self.candidates = candidates

    @staticmethod
    def _take(seg: Segment, cand: Candidate) -> None:
        seg.response_ids += cand.ids
        seg.mask += [1] * len(cand.ids)
        seg.logprobs += cand.logprobs
        seg.versions += [cand.version] * len(cand.ids)

    def finish(self) -> Segment | None:
        """The trained segment: the last one, with the last call's first answer (the answer
        an agent ends on is the one it read). None when the agent never called."""
        seg = self.current
        if seg is not None and self.candidates:
            self._take(seg, self.candidates[0])
            self.last_finished = self.candidates[0].finished
            self.candidates = []
        return seg

    def stats(self) -> dict[str, float]:
        earlier = self.segments[:-1]
        return {
            "requests": float(self.requests),
            "segments": float(len(self.segments)),
            "splits": float(self.splits),
            "untrained_tokens": float(sum(s.model_tokens() for s in earlier)),
        }
