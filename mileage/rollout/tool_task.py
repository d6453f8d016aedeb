"""The built-in tool task `addition-tool`: sums of two 5-digit numbers, with a calculator.

A prompt is `48213+39075=` and the answer is the sum written the usual way, most significant
digit first (`87288`). Written that way a sum is hard for the ~3M-parameter character model: the first
digit depends on every carry to its right, which it must foresee. A calculator makes it easy. The
model calls it in a compact format suited to a character tokenizer, one token per character:

    48213+39075=[48213+39075]<eos>{87288}87288<eos>
                ^^^^^^^^^^^^^^^^^^ model turn 1: the call, trained (loss mask 1)
                                  ^^^^^^^ the tool's result, appended by the tool loop (mask 0)
                                         ^^^^^^^^^^ model turn 2: the answer, trained

The model may also answer at once (`48213+39075=87288<eos>`). Its warm-up data mixes both
(`TOOL_SHARE` of the trajectories call the tool), so the warm-started policy calls the tool only
sometimes and is weak without it; RL has to discover that calling pays.

Everything here is a pure function: the records of a split, the calculator, the call format
(`format_call` and the `calc` parser, which round-trip) and the scorer of a finished trajectory.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from mileage.rollout.tool_parsers import CALC_TOOL, ParsedCall, parse_calc, render_calc

TASK = "addition-tool"
TOOL_NAME = CALC_TOOL
DIGITS = 5
RECORDS = 20_000
# share of the warm-up trajectories that call the calculator
TOOL_SHARE = 0.25
RESULT_CLOSE = "}"
# characters this task adds to the built-in alphabet (after it, so the other tasks' ids stay):
# the call and result brackets of the `calc` parser (mileage/rollout/tool_parsers.py)
EXTRA_ALPHABET = "[]{}"
# what the calculator accepts: non-negative integers joined by + - *, at most this long
MAX_EXPRESSION = 32
_EXPRESSION = re.compile(r"\d{1,12}(?:[-+*]\d{1,12})*")
# the tool's description in the OpenAI function format; a chat model given the task gets it as
# the template's tools= (the built-in character model has no template and never reads it)
TOOL_SPECS_PATH = Path(__file__).resolve().parent / "calculator_tools.json"
# the flags the task sets unless given (run_config.TASK_DEFAULTS): the tool loop with the
# calculator and the `calc` format; a call, its result and the answer take 2 model turns of at
# most 14 tokens each (`[12345+67890]` and EOS)
RUN_DEFAULTS = {
    "generate_execute_tool_function_path": f"{__name__}:execute_tool",
    "generate_tool_specs_path": str(TOOL_SPECS_PATH),
    "generate_tool_call_parser": "calc",
    "generate_max_turns": 2,
    "rollout_max_response_len": 16,
    # the demo's length: long enough to see calling win, short enough for a shared laptop CPU
    "num_rollout": 80,
    "eval_interval": 20,
}


def tool_task_records(count: int = RECORDS) -> list[dict[str, str]]:
    """`count` distinct `a+b=` prompts with two DIGITS-digit operands and their plain sums."""
    rng = random.Random(f"mileage-{TASK}")
    low, high = 10 ** (DIGITS - 1), 10**DIGITS - 1
    seen: set[tuple[int, int]] = set()
    records = []
    while len(records) < count:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (a, b) not in seen:
            seen.add((a, b))
            records.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    return records


def calculator(expression: str) -> str:
    """The value of `expression` (non-negative integers joined by + - *) as decimal text.

    Anything else raises ValueError: the rollout then ends that trajectory with a recorded
    reason, as for any tool that fails."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION or not _EXPRESSION.fullmatch(text):
        raise ValueError(f"not an expression of + - * over non-negative integers: {text!r}")
    total, term, sign = 0, 1, 1
    # numbers and operators alternate: fold products into `term`, sums into `total`
    tokens = re.findall(r"\d+|[-+*]", text)
    term = int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            term *= int(number)
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), int(number)
    return str(total + sign * term)


def execute_tool(name: str, arguments: dict) -> str:
    """Run the built-in task's one tool; an unknown name or bad arguments raise ValueError."""
    if name != TOOL_NAME:
        raise ValueError(f"unknown tool {name!r}; the built-in task has only {TOOL_NAME!r}")
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ValueError(f"{TOOL_NAME} takes a string 'expression', got {arguments!r}")
    return calculator(expression)


def format_call(call: ParsedCall) -> str:
    """The text the model writes for a calculator `call` (what `parse_calc` reads back)."""
    return f"[{call.arguments['expression']}]"


def calc_call(expression: str) -> ParsedCall:
    return ParsedCall(TOOL_NAME, {"expression": expression})


def format_result(output: str) -> str:
    """The text the rollout appends after a call (`render_calc`): the output between braces."""
    return render_calc([output])


def final_answer(response: str) -> str:
    """The model's answer in a whole response: what follows the last tool result."""
    return response.rsplit(RESULT_CLOSE, 1)[-1].strip()


def tool_task_reward(prompt: str, response: str, label: str) -> float:
    """1 when the final answer (after any tool results) is the sum, else 0."""
    return float(final_answer(response) == label.strip())


def warmup_segments(record: dict[str, str], use_tool: bool, eos: str) -> list[tuple[str, bool]]:
    """A demonstration for `record` as (text, trained) pieces after the prompt: the answer
    alone, or the call, the calculator's result (not trained: the model reads it, never writes
    it) and the answer."""
    if not use_tool:
        return [(record["label"] + eos, True)]
    expression = record["prompt"].rstrip("=")
    return [
        (format_call(calc_call(expression)) + eos, True),
        (format_result(calculator(expression)), False),
        (record["label"] + eos, True),
    ]


def warmup_records(records: list[dict[str, str]], eos: str) -> list[dict]:
    """The warm-up set: each record with its demonstration; a fixed `TOOL_SHARE` call the tool
    (chosen by a generator of its own, so the choice is a pure function of the records)."""
    rng = random.Random(f"mileage-{TASK}-warmup")
    return [{**r, "segments": warmup_segments(r, rng.random() < TOOL_SHARE, eos)} for r in records]


def greedy_tool_check(
    model, tokenizer, records: list[dict[str, str]], max_turns: int = 2, force_call: bool = False
) -> tuple[float, float]:
    """(accuracy, tool-use rate) of greedy answers to `records`, calling the calculator the way
    the tool loop does: a turn that ends in a call gets the result appended as ids, never
    re-tokenized text. `force_call` starts every answer with the call's `[`, which measures the
    tool path alone. The warm-up's progress check; rollouts go through the tool loop."""
    from mileage.rollout.engine import LocalEngine, SamplingParams

    engine = LocalEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    params = SamplingParams(max_new_tokens=2 * DIGITS + 4, temperature=0.0)
    opening = "[" if force_call else ""
    ids = [tokenizer(r["prompt"] + opening)["input_ids"] for r in records]
    texts = [opening] * len(records)
    called = [False] * len(records)
    live = list(range(len(records)))
    for turn in range(max_turns):
        if not live:
            break
        out = engine.generate([ids[i] for i in live], params)
        following = []
        for i, completion in zip(live, out, strict=True):
            ids[i] = ids[i] + completion.response_ids
            text = tokenizer.decode(completion.response_ids, skip_special_tokens=True)
            texts[i] += text
            calls = parse_calc(texts[i] if turn == 0 else text)
            if not calls or not completion.finished or turn + 1 == max_turns:
                continue
            called[i] = True
            try:
                result = format_result(execute_tool(TOOL_NAME, calls[0].arguments))
            except ValueError:
                continue
            texts[i] += result
            ids[i] = ids[i] + tokenizer(result, add_special_tokens=False)["input_ids"]
            following.append(i)
        live = following
    correct = [
        tool_task_reward(r["prompt"], t, r["label"]) for r, t in zip(records, texts, strict=True)
    ]
    return sum(correct) / len(records), sum(called) / len(records)


def warmup_check(model, tokenizer, records: list[dict[str, str]]) -> tuple[float, float, float]:
    """The warm-up's stopping measure first: (greedy accuracy when every answer calls the tool,
    greedy accuracy as the model chooses, greedy tool-use rate)."""
    forced, _ = greedy_tool_check(model, tokenizer, records, force_call=True)
    return (forced, *greedy_tool_check(model, tokenizer, records))
