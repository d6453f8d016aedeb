"""The built-in tool task `addition-tool`: its data, calculator, call format and warm-up data."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from conftest import REPO

from mileage.rollout import tool_task
from mileage.rollout.tasks import TASKS, builtin_alphabet, builtin_task
from mileage.rollout.tool_parsers import PARSERS, tool_format
from mileage.rollout.tool_task import (
    calc_call,
    calculator,
    execute_tool,
    final_answer,
    format_call,
    format_result,
    tool_task_reward,
    warmup_records,
)

DIGEST = (
    "import hashlib, json; from mileage.rollout.tasks import builtin_task; "
    "print(hashlib.sha256(json.dumps(builtin_task('addition-tool')).encode()).hexdigest())"
)


def test_task_data_is_a_pure_function_of_its_name():
    train, test = builtin_task("addition-tool")
    assert "addition-tool" in TASKS
    assert len(train) + len(test) == tool_task.RECORDS and len(test) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for record in train[:200] + test[:200]:
        a, b = record["prompt"].rstrip("=").split("+")
        assert len(a) == len(b) == 4 and record["label"] == str(int(a) + int(b))
    # another process with another hash seed builds the same records in the same order
    here = hashlib.sha256(json.dumps([train, test]).encode()).hexdigest()
    for hash_seed in ("1", "987"):
        out = subprocess.run(
            [sys.executable, "-c", DIGEST],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": hash_seed},
            check=True,
        )
        assert out.stdout.strip() == here


def test_alphabet_extends_the_others_without_moving_their_ids():
    base, tool = builtin_alphabet(), builtin_alphabet("addition-tool")
    assert tool.startswith(base) and tool[len(base) :] == "[]{}"
    assert builtin_alphabet("addition") == base


@pytest.mark.parametrize(
    ("expression", "value"),
    [("4821+3907", "8728"), ("7-9", "-2"), ("2+3*4", "14"), ("2*3+4*5-6", "20"), (" 12 ", "12")],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value
    assert execute_tool("calculator", {"expression": expression}) == value


@pytest.mark.parametrize("expression", ["", "1+", "+1", "1/2", "1++2", "a+1", "9" * 40, "1 + 2"])
def test_calculator_refuses_what_it_cannot_evaluate(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_execute_tool_refuses_other_tools_and_arguments():
    with pytest.raises(ValueError, match="unknown tool"):
        execute_tool("search", {"expression": "1+1"})
    with pytest.raises(ValueError, match="expression"):
        execute_tool("calculator", {"expr": "1+1"})


def test_call_format_round_trips_through_the_registered_parser():
    calc = tool_format("calc")  # --generate-tool-call-parser calc
    assert PARSERS["calc"] is calc
    for expression in ("4821+3907", "1", "2*3-4", ""):
        call = calc_call(expression)
        assert calc.parse(format_call(call)) == [call]
        # around other text, and more than one call in a turn, in order
        text = f"so {format_call(call)} and {format_call(calc_call('1+1'))}"
        assert calc.parse(text) == [call, calc_call("1+1")]
    assert calc.parse("8728") == [] and calc.parse("[12+3") == [] and calc.parse("]1[") == []
    # what the tool loop appends after a turn is what the warm-up taught the model to read
    assert calc.render(["8728"]) == format_result("8728") == "{8728}"


def test_final_answer_follows_the_last_tool_result():
    response = format_call(calc_call("4821+3907")) + format_result("8728") + "8728"
    assert final_answer(response) == "8728"
    assert tool_task_reward("4821+3907=", response, "8728") == 1.0
    assert tool_task_reward("4821+3907=", "8728", "8728") == 1.0
    assert tool_task_reward("4821+3907=", response[:-1], "8728") == 0.0
    # a call without an answer after its result earns nothing
    assert tool_task_reward("4821+3907=", response[:-4], "8728") == 0.0


def test_warmup_mixes_direct_answers_and_tool_trajectories():
    train, _ = builtin_task("addition-tool")
    records = warmup_records(train, "<eos>")
    assert records == warmup_records(train, "<eos>")
    with_tool = [r for r in records if len(r["segments"]) == 3]
    share = len(with_tool) / len(records)
    assert abs(share - tool_task.TOOL_SHARE) < 0.02
    call, result, answer = with_tool[0]["segments"]
    expression = with_tool[0]["prompt"].rstrip("=")
    assert call == (f"[{expression}]<eos>", True)
    # the calculator's output is read, never trained on
    assert result == (f"{{{with_tool[0]['label']}}}", False)
    assert answer == (with_tool[0]["label"] + "<eos>", True)
    direct = next(r for r in records if len(r["segments"]) == 1)
    assert direct["segments"] == [(direct["label"] + "<eos>", True)]
