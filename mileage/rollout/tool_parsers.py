"""Tool-call parsers (`--generate-tool-call-parser NAME`): model text -> the tool calls in it.

A parser is one function `parse(text) -> list[ParsedCall]` that raises `ToolCallError` for a
call it recognises but cannot read (the trajectory then ends with reason `tool_error`), and one
entry in `PARSERS`, which pairs it with how tool outputs are written back into the context when
the tokenizer has no chat template (`render`). With a chat template the outputs go through the
template as `tool` messages instead (`mileage.rollout.multiturn`).

Adding a format: write `parse` (and a `render` if the default one does not suit the model) and
call `register_parser("name", parse, render)` at import time of a module the run imports, or add
an entry to `PARSERS` here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mileage.errors import UserError


class ToolCallError(ValueError):
    """A tool call the parser recognised but could not read (bad JSON, no name, ...)."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


Parse = Callable[[str], list[ParsedCall]]
# tool outputs of one turn (in call order) -> the plain text appended after the model's turn
Render = Callable[[list[str]], str]


@dataclass(frozen=True)
class ToolFormat:
    parse: Parse
    render: Render
    # what a call looks like in the text: the agent endpoint (mileage.rollout.agents) returns a
    # turn's text without it as the message content (None: the whole text)
    pattern: re.Pattern[str] | None = None

    def content(self, text: str) -> str:
        """The turn's text without its tool calls."""
        return self.pattern.sub("", text).strip() if self.pattern is not None else text


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ParsedCall]:
    """Qwen2.5/Qwen3/Hermes: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (arguments may also be a JSON string holding the object)."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call is not JSON ({exc.msg})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallError("tool call has no string 'name'")
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ToolCallError(f"tool call arguments are not JSON ({exc.msg})") from None
        if not isinstance(arguments, dict):
            raise ToolCallError("tool call arguments are not a JSON object")
        calls.append(ParsedCall(call["name"], arguments))
    return calls


def render_hermes(outputs: list[str]) -> str:
    """The outputs as Qwen's template writes tool results, without the template's role tags."""
    return "".join(f"\n<tool_response>\n{out}\n</tool_response>" for out in outputs) + "\n"


# The built-in character model's compact format (`--builtin-task addition-tool`,
# mileage/rollout/tool_task.py): one character per token, so a call is as short as can be:
# `[EXPRESSION]` calls the calculator, and its output comes back between braces, `{OUTPUT}`.
CALC_TOOL = "calculator"
CALC_CALL = re.compile(r"\[([^\[\]]*)\]")


def parse_calc(text: str) -> list[ParsedCall]:
    """Each `[EXPRESSION]` in the text is a calculator call (`{"expression": EXPRESSION}`)."""
    return [ParsedCall(CALC_TOOL, {"expression": m.group(1)}) for m in CALC_CALL.finditer(text)]


def render_calc(outputs: list[str]) -> str:
    return "".join(f"{{{out}}}" for out in outputs)


PARSERS: dict[str, ToolFormat] = {
    "calc": ToolFormat(parse_calc, render_calc, CALC_CALL),
    # sglang's names for the same format, so miles' flag values work unchanged
    "qwen25": ToolFormat(parse_hermes, render_hermes, _TOOL_CALL),
    "qwen": ToolFormat(parse_hermes, render_hermes, _TOOL_CALL),
    "hermes": ToolFormat(parse_hermes, render_hermes, _TOOL_CALL),
}
DEFAULT_PARSER = "qwen25"


def register_parser(
    name: str, parse: Parse, render: Render = render_hermes, pattern: str | None = None
) -> None:
    """Make `--generate-tool-call-parser name` select `parse` (and `render`). A name already
    taken by another function is refused: replacing a built-in parser silently would change
    what every run using that name trains on. (Registering the same function again, as a
    re-imported module does, is allowed.) `pattern`, a regular expression matching one call
    in the text, lets the agent endpoint return a turn's text without its calls."""
    known = PARSERS.get(name)
    if known is not None and _qualified(known.parse) != _qualified(parse):
        raise UserError(
            f"tool-call parser {name!r} is already registered ({_qualified(known.parse)}); "
            "register yours under another name"
        )
    PARSERS[name] = ToolFormat(parse, render, re.compile(pattern, re.DOTALL) if pattern else None)


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def tool_format(name: str) -> ToolFormat:
    if name not in PARSERS:
        raise UserError(
            f"--generate-tool-call-parser {name!r} does not exist; known: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]
