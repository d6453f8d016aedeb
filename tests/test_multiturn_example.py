"""examples/search_r1.py against the interface: a scripted model that searches, then answers,
in process; the example through `mileage train` for one short rollout; and the multi-turn
flags' bad input through the CLI (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
from conftest import builtin_train_args

from mileage.cli.main import main
from mileage.rollout.agent import Agent, load_user_functions
from mileage.rollout.data import Prompt
from mileage.rollout.engines.base import Completion, SamplingParams
from mileage.rollout.multiturn import MultiTurnConfig
from mileage.rollout.rewards import load_custom_reward
from mileage.rollout.rollout import PromptEncoder, generate_samples

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "search_r1.py"
TOOLS = REPO / "tests" / "multiturn_tools.py"


class ByteTokenizer:
    """Bytes as ids (+3); 1 is EOS, 2 BOS; no chat template."""

    eos_token_id = 1
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [b + 3 for b in text.encode()]
        return {"input_ids": ([2] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode()


class SearchThenAnswer:
    """Searches first; answers once the context holds the search results."""

    in_process = False
    weight_version = 0

    def __init__(self, tok):
        self.tok = tok
        self.inputs: list[list[int]] = []

    def generate(self, prompts, params, seed=None, group_size=1):
        out = []
        for ids in prompts:
            self.inputs.append(list(ids))
            text = self.tok.decode(ids)
            answer = (
                "<answer>Paris</answer>"
                if "<information>" in text
                else "x<search>capital of france</search>"
            )
            new = self.tok(answer, add_special_tokens=False)["input_ids"] + [1]
            out.append(Completion(list(ids), new, [-0.1] * len(new), True, 0))
        return out


def test_search_r1_example_searches_reads_and_answers(tmp_path):
    mt = MultiTurnConfig(
        custom_generate_function_path=f"{EXAMPLE}:generate",
        generate_execute_tool_function_path=f"{EXAMPLE}:search",
        generate_max_turns=4,
        tool_workers=1,
    )
    config = Namespace(multiturn=mt, reward=Namespace(group_rm=False))
    tok = ByteTokenizer()
    encode = PromptEncoder(tok, False)
    reward = load_custom_reward(f"{EXAMPLE}:reward")
    agent = Agent(config, load_user_functions(mt), tok, encode, reward, tmp_path / "j", 4096)
    engine = SearchThenAnswer(tok)
    prompt = Prompt(0, "Q: what is the capital of France?", "paris")
    params = SamplingParams(max_new_tokens=64)
    try:
        (sample,) = generate_samples(engine, encode, [prompt], params, 1, reward, 3, 0, agent)
    finally:
        agent.close()
    assert sample.reward == 1.0 and sample.turns == 2 and sample.stop_reason == "stop"
    (call,) = sample.tool_calls
    assert (
        call.arguments == {"query": "capital of france"} and "Paris is the capital" in call.output
    )
    info = call.output_ids
    first_turn = len(engine.inputs[1]) - len(sample.prompt_ids) - len(info)
    assert sample.loss_mask == [1] * first_turn + [0] * len(info) + [1] * (
        len(sample.response_ids) - first_turn - len(info)
    )
    # the answer turn saw exactly the prompt, the search turn and the search results
    assert engine.inputs[1] == sample.prompt_ids + sample.response_ids[: first_turn + len(info)]


def test_search_r1_example_runs_a_rollout_of_mileage_train(builtin_model, tmp_path, capsys):
    save = tmp_path / "run"
    args = builtin_train_args(
        "--num-rollout", "1",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2",
        "--custom-generate-function-path", f"{EXAMPLE}:generate",
        "--generate-execute-tool-function-path", f"{EXAMPLE}:search",
        "--custom-rm-path", f"{EXAMPLE}:reward",
        "--save", str(save),
    )  # fmt: skip
    assert main(["train", *args]) == 0, capsys.readouterr().err
    (record,) = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/mean_turns"] >= 1.0 and "rollout/tool_calls" in record


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--custom-generate-function-path", "no_such_module_xyz:generate"], "cannot import"),
        (
            ["--custom-generate-function-path", f"{EXAMPLE}:search"],
            "must be callable as async def generate(ctx, sample, params)",
        ),
        (["--generate-tool-specs-path", "TOOLS_NOT_JSON"], "is not JSON"),
        (
            [
                "--generate-execute-tool-function-path", f"{TOOLS}:tool",
                "--generate-tool-call-parser", "nope",
            ],
            "--generate-tool-call-parser 'nope' does not exist",
        ),
        (["--custom-rm-path", f"{TOOLS}:wrong_arity", "--group-rm"], "fn(config, samples)"),
        (["--generate-max-turns", "0"], "--generate-max-turns must be positive"),
    ],
)  # fmt: skip
def test_bad_multi_turn_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    bad = tmp_path / "tools.json"
    bad.write_text("[{'name': 'search'}]")  # Python, not JSON
    extra = [str(bad) if e == "TOOLS_NOT_JSON" else e for e in extra]
    save = tmp_path / "run"
    code = main(["train", *builtin_train_args("--save", str(save)), *extra])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("mileage: error: ") and message in lines[0], err
    assert not save.exists()
