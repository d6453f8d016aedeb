"""A ReAct agent written against the plain `openai` client, trained by mileage unchanged.

    mileage train --builtin-task addition-tool --agent-function-path examples/openai_agent.py:agent

The agent sees the task's prompt (`48213+39075=`), asks the model, runs the calculator when the
model calls it, hands the result back as a tool message and asks again, until the model answers
without a call. It knows nothing of mileage: `base_url` and `api_key` point it at the run's
OpenAI-compatible endpoint, whose every answer is the policy's, recorded token for token. It
returns None, so the run's reward (the task's own) scores the final answer; return a number to
score it yourself.

It stops where the task's own tool loop stops (a turn cut off by its token limit, a call the
calculator cannot run, no room left in the context), so it trains exactly what that loop trains.
It is deterministic given what the endpoint answers (no clock, no randomness of its own), which
is what lets a killed run resume bit for bit (docs/agents.md).
"""

from __future__ import annotations

import json
import ssl

import httpx
from openai import AsyncOpenAI, BadRequestError

from mileage.rollout.tool_task import TOOL_SPECS_PATH, calculator

TOOLS = json.loads(TOOL_SPECS_PATH.read_text())
MAX_STEPS = 2  # model turns: a call and the answer (the task's own limit)
# one TLS context for every client: building one loads the CA bundle (~20 ms), which a client
# per sample would otherwise pay each time (the endpoint itself is plain HTTP on 127.0.0.1)
TLS = ssl.create_default_context()


def run_tool(name: str, arguments: str) -> str | None:
    """The tool's output, or None when the call cannot be run."""
    try:
        if name != "calculator":
            return None
        return calculator(json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError):
        return None


async def agent(base_url: str, api_key: str, sample) -> float | None:
    client = AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx.AsyncClient(verify=TLS)
    )
    messages: list[dict] = [{"role": "user", "content": sample.prompt.text}]
    try:
        for _ in range(MAX_STEPS):
            try:
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, max_tokens=16
                )
            except BadRequestError:
                break  # no room left in the model's context: the last answer stands
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason != "tool_calls":
                break  # an answer (or a turn cut off by its token limit)
            for call in choice.message.tool_calls:
                output = run_tool(call.function.name, call.function.arguments)
                if output is None:
                    return None  # a call the calculator cannot run ends the attempt
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    finally:
        await client.close()
    return None  # the run's reward scores the trajectory's final answer
