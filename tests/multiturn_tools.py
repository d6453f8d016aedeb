"""Scripted tools and a tool-call format for the multi-turn tests (loaded by path, as users do:
`--generate-execute-tool-function-path tests/multiturn_tools.py:tool`).

The built-in model writes digits, so its "tool call" is a turn that starts with an odd digit:
the tool `rev` answers with the digits reversed; `7...` makes it raise and `9...` makes it hang.
Outputs go back into the context as `=OUTPUT>` (the `odd_digit` parser's plain-text render).
"""

from __future__ import annotations

import os
import time

from mileage.rollout.tool_parsers import ParsedCall, register_parser


def parse_odd_digit(text: str) -> list[ParsedCall]:
    text = text.strip()
    if text and text[0] in "13579":
        return [ParsedCall("rev", {"x": text})]
    return []


def render(outputs: list[str]) -> str:
    return "".join(f"={out}>" for out in outputs)


register_parser("odd_digit", parse_odd_digit, render)


def tool(name: str, arguments: dict) -> str:
    """Deterministic: reversed digits; raises on 7..., hangs on 9..."""
    x = arguments["x"]
    if x.startswith("7"):
        raise ValueError(f"cannot handle {x}")
    if x.startswith("9"):
        time.sleep(3600)
    return x[::-1]


def tool_nondet(name: str, arguments: dict) -> str:
    """Like `tool`, plus a letter that differs from call to call (a tool with outside state)."""
    out = tool(name, arguments)
    return out + "abcdefghijklmnopqrstuvwxyz"[os.urandom(1)[0] % 26]


def tool_counted(name: str, arguments: dict) -> str:
    """Reversed digits, never failing, each call appended to $MILEAGE_TEST_TOOL_LOG if set (to
    count how many times a tool really ran, e.g. once and not once per rank)."""
    log = os.environ.get("MILEAGE_TEST_TOOL_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{arguments['x']}\n")
    return arguments["x"][::-1]


async def tool_async(name: str, arguments: dict) -> str:
    return tool(name, arguments)


def wrong_arity(name: str) -> str:
    return name
