"""Built-in procedurally generated tasks with verifiable answers.

`addition`: two 2-digit numbers, answer written least-significant digit first ("07+45=" -> "25"),
which makes carries learnable left to right. `reversal`: reverse a short lowercase string
("abcd>" -> "dcba"). `addition-tool` (rollout/tool_task.py): sums of two 5-digit numbers, with a
calculator the model may call. Every split is a pure function of the task name, so any machine builds the
same prompts in the same order.
"""

from __future__ import annotations

import random

from mileage.rollout import tool_task

TASKS = ("addition", "reversal", "mixed", tool_task.TASK)
HELD_OUT_SIZE = 500
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _addition() -> list[dict[str, str]]:
    return [
        {"prompt": f"{a:02d}+{b:02d}=", "label": str(a + b)[::-1]}
        for a in range(100)
        for b in range(100)
    ]


def _reversal(count: int = 10_000) -> list[dict[str, str]]:
    rng = random.Random("mileage-reversal")
    seen: set[str] = set()
    records = []
    while len(records) < count:
        text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        if text not in seen:
            seen.add(text)
            records.append({"prompt": f"{text}>", "label": text[::-1]})
    return records


def _split(records: list[dict[str, str]], name: str) -> tuple[list, list]:
    order = list(range(len(records)))
    random.Random(f"mileage-split-{name}").shuffle(order)
    # the training split comes in this fixed random order: file order would feed RL batches
    # like "00+00".."00+15" that all share one operand
    train = [records[i] for i in order[HELD_OUT_SIZE:]]
    test = [records[i] for i in sorted(order[:HELD_OUT_SIZE])]
    return train, test


def builtin_task(name: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, held-out) records with keys `prompt` and `label` for a built-in task."""
    if name == "addition":
        return _split(_addition(), name)
    if name == "reversal":
        return _split(_reversal(), name)
    if name == tool_task.TASK:
        return _split(tool_task.tool_task_records(), name)
    if name == "mixed":
        add_train, add_test = builtin_task("addition")
        rev_train, rev_test = builtin_task("reversal")
        half = HELD_OUT_SIZE // 2
        train = [r for pair in zip(add_train, rev_train, strict=False) for r in pair]
        return train, add_test[:half] + rev_test[:half]
    raise ValueError(f"unknown built-in task {name!r}; choose from {', '.join(TASKS)}")


def builtin_alphabet(task: str | None = None) -> str:
    """Every character the prompts and answers of the built-in tasks use; `addition-tool` adds
    its call and result brackets at the end (so the ids of the others' characters stay)."""
    base = "0123456789+=>" + LETTERS
    return base + tool_task.EXTRA_ALPHABET if task == tool_task.TASK else base
