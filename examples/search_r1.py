"""A Search-R1-style tool loop written against mileage's generate-function interface.

The model thinks, may ask a search engine with `<search>query</search>`, reads the results the
loop appends as `<information>...</information>` (tool tokens: loss mask 0, never trained), and
ends with `<answer>...</answer>`; the reward is 1 when the answer matches the label. It is a port
of the loop of slime's search-r1 example and of Search-R1 (Jin et al., 2025), written anew.

Run it (any model whose tokenizer can write the tags; a JSONL of {"prompt", "label"}):

    mileage train --hf-checkpoint MODEL --prompt-data questions.jsonl \\
        --custom-generate-function-path examples/search_r1.py:generate \\
        --generate-execute-tool-function-path examples/search_r1.py:search \\
        --custom-rm-path examples/search_r1.py:reward --generate-max-turns 4

`search` here looks up a tiny built-in corpus, so the example runs offline; point it at a real
retriever (an HTTP call is fine: it runs in a killable worker process, bounded by
--tool-timeout, and its answers are journaled, so a resumed run sees the same results).
"""

from __future__ import annotations

import re

from mileage.rollout.engines.base import SamplingParams
from mileage.rollout.multiturn import GenerateContext
from mileage.rollout.sample import LENGTH, MAX_TURNS, STOP, Sample, ToolCall

SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

CORPUS = {
    "capital of france": "Paris is the capital and largest city of France.",
    "tallest mountain": "Mount Everest, 8,849 m, is Earth's highest mountain above sea level.",
    "largest planet": "Jupiter is the largest planet in the Solar System.",
}


def search(name: str, arguments: dict) -> str:
    """The retriever: top passage for the query (the tool the run executes in a worker)."""
    query = str(arguments.get("query", "")).lower()
    hits = [text for key, text in CORPUS.items() if key in query or query in key]
    return hits[0] if hits else "No results."


async def generate(ctx: GenerateContext, sample: Sample, params: SamplingParams) -> Sample:
    max_turns = ctx.config.multiturn.generate_max_turns
    tok = ctx.tokenizer
    context = list(sample.prompt_ids)
    for turn in range(max_turns):
        budget = ctx.max_context_len - len(context)
        if budget <= 0:
            sample.stop_reason = LENGTH
            break
        out = await ctx.client.generate(context, min(params.max_new_tokens, budget))
        context += out.ids
        sample.response_ids += out.ids
        sample.logprobs += out.logprobs
        sample.loss_mask += [1] * len(out.ids)
        sample.weight_versions += [out.weight_version] * len(out.ids)
        sample.turns = turn + 1
        text = tok.decode(out.ids, skip_special_tokens=True)
        query = SEARCH.search(text)
        if out.finish_reason == "length":
            sample.stop_reason = LENGTH
            break
        if query is None or ANSWER.search(text):
            sample.stop_reason = STOP
            break
        if turn == max_turns - 1:
            sample.stop_reason = MAX_TURNS
            break
        arguments = {"query": query.group(1).strip()}
        result = await ctx.call_tool("search", arguments, turn)
        call = ToolCall(turn, "search", arguments, result.status, result.output)
        sample.tool_calls.append(call)
        if result.status != "ok":
            sample.stop_reason = result.status
            break
        info = tok(f"\n<information>{result.output}</information>\n", add_special_tokens=False)
        call.output_ids = list(info["input_ids"])
        context += call.output_ids
        sample.response_ids += call.output_ids
        sample.logprobs += [0.0] * len(call.output_ids)
        sample.loss_mask += [0] * len(call.output_ids)
        sample.weight_versions += [out.weight_version] * len(call.output_ids)
    sample.response = tok.decode(sample.response_ids, skip_special_tokens=True)
    sample.finished = sample.stop_reason != LENGTH
    if sample.weight_versions:
        sample.weight_version = sample.weight_versions[0]
    return sample


def reward(args, sample: Sample) -> float:
    """1.0 when the last <answer> matches the label (case and spaces aside), else 0.0."""
    answers = ANSWER.findall(sample.response)
    if not answers:
        return 0.0
    return float(answers[-1].strip().lower() == sample.prompt.label.strip().lower())
