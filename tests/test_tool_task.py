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
        assert len(a) == len(b) == tool_task.DIGITS and record["label"] == str(int(a) + int(b))
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


@pytest.fixture(scope="module")
def tool_model(mileage_home):
    """The shipped addition-tool model (unpacked, never warmed up here)."""
    import torch

    from mileage.rollout.builtin_model import SHIPPED_WEIGHTS, ensure_builtin_model

    assert "addition-tool" in SHIPPED_WEIGHTS
    with torch.random.fork_rng():
        return ensure_builtin_model("addition-tool")


def test_warmed_model_calls_the_tool_only_sometimes(tool_model):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from mileage.rollout.builtin_model import (
        SHIPPED_DIR,
        SHIPPED_WEIGHTS,
        file_sha256,
        warmup_recipe,
    )

    pinned = SHIPPED_WEIGHTS["addition-tool"]
    assert file_sha256(SHIPPED_DIR / "addition-tool.safetensors") == pinned
    info = json.loads((tool_model / "mileage_builtin.json").read_text())
    recipe = warmup_recipe("addition-tool")
    assert info["sha256"] == pinned and {k: info[k] for k in recipe} == json.loads(
        json.dumps(recipe)
    )
    _, test = builtin_task("addition-tool")
    model = LlamaForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    # the tool path works: made to call, the model writes the call and copies the result
    forced, _ = tool_task.greedy_tool_check(model, tokenizer, test[:200], force_call=True)
    assert forced >= info["greedy_accuracy_calling_the_tool"] - 0.15, forced
    # left to itself (greedy) it rarely calls, and its direct answers are much worse; sampled,
    # it calls on some prompts (the end-to-end run below counts them)
    accuracy, tool_rate = tool_task.greedy_tool_check(model, tokenizer, test[:200])
    assert tool_rate < 0.5, tool_rate
    assert accuracy < forced - 0.2, (accuracy, forced)


def test_two_rollouts_end_to_end_with_masked_tool_tokens(tool_model, cli, tmp_path):
    """`mileage train --builtin-task addition-tool` turns on the tool loop by itself; the saved
    samples show calls whose results are in the response with loss mask 0, and every metric the
    demo reports is logged."""
    from transformers import AutoTokenizer

    save = tmp_path / "run"
    # a slice of the held-out split keeps the two evaluations short
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in builtin_task("addition-tool")[1][:32]))
    out = cli(
        "train",
        "--builtin-task",
        "addition-tool",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "8",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        "held",
        str(held),
        # sampled evaluation calls the tool as often as the rollouts do, if it runs the tool loop
        "--n-samples-per-eval-prompt",
        "4",
        "--num-threads",
        "1",
        "--save-debug-rollout-data",
        str(tmp_path / "samples_{rollout_id}.json"),
        "--save",
        str(save),
        "--load",
        str(save),
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--generate-tool-call-parser calc" in out.stdout
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/held/tool_use_rate" in r]
    assert [r["rollout_id"] for r in evals] == [-1, 1]
    assert all(0.0 <= r["eval_accuracy"] <= r["eval/held/pass@4"] <= 1.0 for r in evals)
    assert all(0 < r["eval/held/tool_use_rate"] < 1 for r in evals)
    rollouts = [r for r in records if "rollout/tool_use_rate" in r]
    assert len(rollouts) == 2 and all(0 < r["rollout/tool_use_rate"] < 1 for r in rollouts)

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    samples = [
        s
        for i in (0, 1)
        for s in json.loads((tmp_path / f"samples_{i}.json").read_text())["samples"]
    ]
    called = [s for s in samples if s["tool_calls"]]
    assert called and len(called) < len(samples)
    ok = [s for s in called if s["tool_calls"][0]["status"] == "ok"]
    assert ok
    for s in ok:
        call = s["tool_calls"][0]
        assert call["name"] == "calculator"
        assert call["output"] == calculator(call["arguments"]["expression"])
        mask, ids = s["loss_mask"], s["response_ids"]
        # the tool's tokens, exactly, and only they, are masked out of the loss
        untrained = [t for t, m in zip(ids, mask, strict=True) if m == 0]
        assert untrained == call["output_ids"]
        assert tokenizer.decode(untrained) == "{" + call["output"] + "}"
        first = mask.index(0)
        assert tokenizer.decode(ids[:first], skip_special_tokens=True).endswith("]")
        assert all(lp == 0.0 for lp, m in zip(s["logprobs"], mask, strict=True) if m == 0)
        assert s["reward"] == tool_task_reward("", s["response"], s["prompt"]["label"])
    for s in samples:
        if not s["tool_calls"]:
            assert set(s["loss_mask"] or [1]) == {1}


def test_warmup_trains_the_call_and_answer_not_the_prompt_or_the_tool_result():
    """The warm-up's conversation records, encoded as `mileage sft` encodes them (with the
    template the warm-up gives the tokenizer): the prompt's ids are a rollout's, and only the
    call and the answer are trained."""
    import copy

    from mileage.rollout.builtin_model import builtin_tokenizer
    from mileage.rollout.builtin_warmup import PLAIN_TEMPLATE, sft_records
    from mileage.rollout.prompts import prompt_from_record
    from mileage.rollout.rollout import PromptEncoder
    from mileage.rollout.sft import sft_sample

    tokenizer = copy.deepcopy(builtin_tokenizer("addition-tool"))
    tokenizer.chat_template = PLAIN_TEMPLATE
    encode = PromptEncoder(tokenizer, chat_template=False)
    record = {"prompt": "4821+3907=", "label": "8728"}
    records = sft_records("addition-tool", [record] * 40, tokenizer.eos_token)
    shapes = {len(r["messages"]) for r in records}
    assert shapes == {2, 4}  # some answer directly, some call the calculator first
    for r in records:
        prompt = prompt_from_record(0, r, "messages", "label", "test")
        sample = sft_sample(prompt, encode, tokenizer.eos_token_id)
        assert sample.prompt_ids == tokenizer(record["prompt"])["input_ids"]  # as RL encodes it
        text = tokenizer.decode(sample.response_ids)
        learned = tokenizer.decode(
            [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
        )
        if len(r["messages"]) == 4:
            assert text == "[4821+3907]<eos>{8728}8728<eos>"
            assert learned == "[4821+3907]<eos>8728<eos>"
        else:
            assert text == learned == "8728<eos>"
