"""Agents for tests/test_agents.py, loaded with --agent-function-path (file.py:fn): what they saw
is kept in RESULTS, by prompt index, for the tests to read."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
from openai import AsyncOpenAI, OpenAI

from mileage.rollout.tool_task import TOOL_SPECS_PATH

RESULTS: dict = {}
TOOLS = json.loads(TOOL_SPECS_PATH.read_text())
RUNS = {"count": 0}  # how many times nondet's second request was made (differs per run)


def _error(call) -> tuple[int, dict]:
    try:
        call()
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body
    raise AssertionError("the request was not refused")


def protocol_probe(base_url: str, api_key: str, sample) -> float:
    """A plain `def` agent on the sync client: every request shape the endpoint takes."""
    out = RESULTS.setdefault(sample.prompt.index, {})
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    create = client.chat.completions.create
    out["models"] = [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": sample.prompt.text}]
    first = create(
        model="policy",
        messages=messages,
        tools=TOOLS,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = first.choices[0]
    out["first"] = {
        "finish": choice.finish_reason,
        "content": choice.message.content,
        "call": (choice.message.tool_calls[0].function.name,
                 choice.message.tool_calls[0].function.arguments),
        "logprobs": [t.logprob for t in choice.logprobs.content],
        "token_ids": choice.token_ids,
        "prompt_token_ids": first.prompt_token_ids,
        "usage": first.usage.model_dump(),
    }  # fmt: skip
    # the same request streamed: asked again from the same context
    events = list(
        create(
            model="policy", messages=messages, tools=TOOLS, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    calls = [c for e in events if e.choices for c in (e.choices[0].delta.tool_calls or [])]
    out["stream"] = {
        "calls": [(c.function.name, c.function.arguments) for c in calls],
        "finish": [e.choices[0].finish_reason for e in events if e.choices][-1],
        "usage": events[-1].usage.model_dump() if events[-1].usage else None,
    }
    out["n2"] = len(create(model="policy", messages=messages, n=2).choices)
    messages.append(choice.message.model_dump(exclude_none=True))
    call_id = choice.message.tool_calls[0].id
    messages.append({"role": "tool", "tool_call_id": call_id, "content": sample.prompt.label})
    short = create(model="policy", messages=messages, max_tokens=2)
    out["short"] = (short.choices[0].message.content, short.choices[0].finish_reason)
    stopped = create(model="policy", messages=messages, stop=[sample.prompt.label[2]])
    out["stopped"] = (stopped.choices[0].message.content, stopped.choices[0].finish_reason)
    streamed = create(model="policy", messages=messages, stream=True)
    out["streamed_text"] = "".join(e.choices[0].delta.content or "" for e in streamed)
    # completions: text, streamed text, token ids
    text = client.completions.create(model="policy", prompt=sample.prompt.text, max_tokens=16)
    out["completion"] = (text.choices[0].text, text.choices[0].finish_reason)
    pieces = client.completions.create(
        model="policy", prompt=sample.prompt.text, max_tokens=16, stream=True
    )
    out["completion_stream"] = "".join(e.choices[0].text for e in pieces)
    ids = out["first"]["prompt_token_ids"]
    by_ids = client.completions.create(model="policy", prompt=ids, max_tokens=16)
    out["completion_ids"] = by_ids.choices[0].text
    # refusals, in OpenAI's error shape
    root_url = base_url.split("/s/")[0] + "/v1"
    out["errors"] = {
        "empty": _error(lambda: create(model="policy", messages=[])),
        "n0": _error(lambda: create(model="policy", messages=messages, n=0)),
        "top_logprobs": _error(
            lambda: create(model="policy", messages=messages, logprobs=True, top_logprobs=2)
        ),
        "too_long": _error(
            lambda: create(model="policy", messages=[{"role": "user", "content": "1" * 200}])
        ),
        "bad_key": _error(
            lambda: OpenAI(
                base_url=root_url, api_key="nope", max_retries=0
            ).chat.completions.create(model="policy", messages=messages)
        ),
    }
    big = httpx.post(f"{base_url}/chat/completions", content=b"x" * (17 << 20), timeout=30)
    out["errors"]["too_large"] = (big.status_code, big.json())
    nowhere = httpx.post(f"{base_url}/embeddings", json={}, timeout=30)
    out["errors"]["no_route"] = (nowhere.status_code, nowhere.json())
    # the key in the Authorization header alone reaches the sample too
    root = OpenAI(base_url=root_url, api_key=api_key, max_retries=0)
    out["by_header"] = (
        root.chat.completions.create(model="policy", messages=messages[:1]).choices[0].finish_reason
    )
    return 1.0


async def splitter(base_url: str, api_key: str, sample) -> None:
    """Calls the calculator, then rewrites the history (drops its own turn): a split."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": sample.prompt.text}]
    )
    assert first.choices[0].message.tool_calls
    summary = [{"role": "user", "content": sample.prompt.text + sample.prompt.label}]
    await client.chat.completions.create(model="policy", messages=summary)
    await client.close()


async def nondet(base_url: str, api_key: str, sample) -> None:
    """Three requests; the second carries a number that changes from run to run, the third is a
    fresh conversation that does not depend on it (so the journal holds a matching entry)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    create = client.chat.completions.create
    messages = [{"role": "user", "content": sample.prompt.text}]
    await create(model="policy", messages=messages)
    RUNS["count"] += 1
    await create(model="policy", messages=[{"role": "user", "content": f"{RUNS['count']}+1="}])
    await create(model="policy", messages=[{"role": "user", "content": "7+7="}])
    await client.close()


async def _ok(base_url: str, api_key: str, sample) -> float | None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": sample.prompt.text}]
    )
    await client.close()
    return 0.5


async def misbehaving(base_url: str, api_key: str, sample):
    """Prompt 0 raises, 1 hangs, 2 returns text, 3 never calls, 4 is fine (reward 0.5)."""
    index = sample.prompt.index
    if index == 1:
        await asyncio.sleep(3600)
    if index == 3:
        return None
    reward = await _ok(base_url, api_key, sample)
    if index == 0:
        raise ValueError("the agent's own bug")
    if index == 2:
        return "high"
    return reward


def sync_ok(base_url: str, api_key: str, sample) -> float:
    """A plain `def` agent (it runs in a thread)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": sample.prompt.text}]
    )
    return 0.25


async def blocking(base_url: str, api_key: str, sample) -> None:
    """Blocks the event loop with a synchronous sleep inside `async def`."""
    time.sleep(2.0)
