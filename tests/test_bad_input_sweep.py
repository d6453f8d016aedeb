"""Every subcommand against broken inputs: one line `mileage: error: ...`, exit 2, the reason named.

Runs `mileage.cli.main.main` in-process (each case fails before any model is built), so the
sweep costs seconds. Permission-denied files cannot be made as root (CI runs as root); a
config.json that is a directory stands in for an unreadable file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import fast_train_args, run_cli

from mileage.cli.main import main

HF_CASES = {
    "missing": ("", "does not exist; --hf-checkpoint must be a Hugging Face model directory"),
    "a file": ("", "is a file; --hf-checkpoint must be a Hugging Face model directory"),
    "no config.json": ("", "has no config.json; --hf-checkpoint must be a Hugging Face model"),
    "config.json is a directory": ("", "has no config.json"),
    "empty config.json": ("config.json", "is empty"),
    "corrupt config.json": ("config.json", "is not valid JSON"),
    "config.json not an object": ("config.json", 'has no "model_type"'),
    "config.json without model_type": ("config.json", 'has no "model_type"'),
    "empty tokenizer.json": ("", "cannot load a tokenizer from"),
    "corrupt tokenizer.json": ("", "cannot load a tokenizer from"),
    "empty weights": ("model.safetensors", "is not a readable safetensors file"),
}
# which subcommands read which part of an HF directory (convert: weights, no tokenizer;
# export-hf: config and tokenizer, no weights)
NEEDS = {
    "train": {"config", "tokenizer", "weights"},
    "plan": {"config", "tokenizer", "weights"},
    "convert": {"config", "weights"},
    "export-hf": {"config", "tokenizer"},
}


def part_of(case: str) -> str:
    return "tokenizer" if "tokenizer" in case else "weights" if "weights" in case else "config"


def broken_hf_dir(tiny_hf: Path, root: Path, case: str) -> Path:
    path = root / "model"
    if case == "missing":
        return path
    if case == "a file":
        path.write_text("not a model\n")
        return path
    shutil.copytree(tiny_hf, path)
    edits = {
        "no config.json": lambda: (path / "config.json").unlink(),
        "config.json is a directory": lambda: (
            (path / "config.json").unlink(),
            (path / "config.json").mkdir(),
        ),
        "empty config.json": lambda: (path / "config.json").write_text(""),
        "corrupt config.json": lambda: (path / "config.json").write_text('{"model_type": '),
        "config.json not an object": lambda: (path / "config.json").write_text("[1, 2]"),
        "config.json without model_type": lambda: (path / "config.json").write_text('{"a": 1}'),
        "empty tokenizer.json": lambda: (path / "tokenizer.json").write_text(""),
        "corrupt tokenizer.json": lambda: (path / "tokenizer.json").write_text("{bad"),
        "empty weights": lambda: (path / "model.safetensors").write_bytes(b""),
    }
    edits[case]()
    return path


def one_line_error(capsys, argv: list) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def trained_run(tiny_hf, tmp_path_factory, mileage_home) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    # in a subprocess: training sets process-wide torch settings (threads, determinism)
    result = run_cli("train", *fast_train_args(tiny_hf, "--num-rollout", 1, "--save", run))
    assert result.returncode == 0, result.stderr
    return run


@pytest.mark.parametrize("command", list(NEEDS))
@pytest.mark.parametrize("case", list(HF_CASES))
def test_broken_hf_checkpoint(capsys, tiny_hf, tmp_path, trained_run, command, case):
    model = broken_hf_dir(tiny_hf, tmp_path, case)
    out = tmp_path / "out"
    argv = {
        "train": ["train", *fast_train_args(model, "--num-rollout", 1, "--save", out)],
        "plan": ["plan", "--hf-checkpoint", model],
        "convert": ["convert", "--hf-checkpoint", model, "--save", out],
        "export-hf": ["export-hf", "--load", trained_run, "--hf-checkpoint", model, "--out", out],
    }[command]
    if part_of(case) not in NEEDS[command]:  # a part this command never reads: it works
        if command != "train":  # (train never gets here: it reads every part)
            assert main([str(a) for a in argv]) == 0
        return
    file, reason = HF_CASES[case]
    line = one_line_error(capsys, argv)
    assert f"{model / file if file else model}" in line and reason in line, line
    assert not out.exists()


def test_bad_paths_of_every_other_subcommand(capsys, tmp_path, trained_run, tiny_hf):
    """ckpt ls/verify, export-hf, plot, smollm2 and train's directories: each named, each exit 2."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    bad_meta = tmp_path / "bad_meta"
    shutil.copytree(trained_run, bad_meta)
    (bad_meta / "iter_0000000/meta.json").write_text("{x")
    runs = {}
    for name, text in {
        "corrupt": '{"rollout_id": 0\n{"rollout_id": 1}\n',
        "foreign": '{"x": 1}\n',
        "empty": "",
    }.items():
        runs[name] = tmp_path / f"run_{name}"
        runs[name].mkdir()
        (runs[name] / "metrics.jsonl").write_text(text)
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    train = fast_train_args(tiny_hf, "--num-rollout", 1)

    cases = [
        (["ckpt", "ls", tmp_path / "nope"], f"{tmp_path / 'nope'} does not exist"),
        (["ckpt", "ls", a_file], f"{a_file} is a file, not a save directory"),
        (["ckpt", "verify", tmp_path / "nope"], f"{tmp_path / 'nope'} does not exist"),
        (["ckpt", "verify", a_file], f"{a_file} is a file, not a save directory"),
        (["convert", "--hf-checkpoint", tiny_hf, "--save", a_file], f"{a_file} is a file"),
        (["export-hf", "--load", empty_dir, "--out", tmp_path / "o"], "has no valid tracker"),
        (
            ["export-hf", "--load", bad_meta, "--out", tmp_path / "o"],
            f"{bad_meta / 'iter_0000000/meta.json'} is unreadable",
        ),
        (
            ["export-hf", "--load", trained_run, "--ckpt-step", 7, "--out", tmp_path / "o"],
            "iter_0000007/meta.json does not exist",
        ),
        (["export-hf", "--load", trained_run, "--out", a_file], f"{a_file} is a file"),
        (
            ["export-hf", "--load", trained_run, "--out", foreign],
            f"{foreign} is a non-empty directory that is not a Hugging Face model",
        ),
        (["plot", a_file], f"{a_file} is not a run directory"),
        (["plot", runs["corrupt"]], "metrics.jsonl:1: not valid JSON"),
        (["plot", runs["foreign"]], "metrics.jsonl:1: not a mileage metrics record"),
        (["plot", runs["empty"]], "no metrics.jsonl records in"),
        (["plot", trained_run, "--out", empty_dir], f"--out {empty_dir}: give a file path"),
        (["smollm2", "--out", a_file], f"{a_file} exists and is not a finished GGUF conversion"),
        (["train", *train, "--save", a_file], f"--save {a_file} is a file, not a directory"),
        (["train", *train, "--load", a_file], f"--load {a_file} is a file, not a directory"),
        (["train", *train, "--ref-load", a_file], f"--ref-load {a_file} is a file"),
    ]
    for argv, message in cases:
        line = one_line_error(capsys, argv)
        assert message in line, (argv, line)
    assert a_file.read_text() == "x\n" and (foreign / "cat.jpg").exists()


def test_a_torn_last_metrics_line_is_dropped_not_fatal(tmp_path):
    """A kill mid-write leaves a last line without its newline; that rollout was never saved."""
    from mileage.metrics import read_metrics

    good = json.dumps({"rollout_id": 0, "reward_mean": 0.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(good + '{"rollout_id": 1, "rew')
    assert read_metrics(tmp_path) == [{"rollout_id": 0, "reward_mean": 0.5}]


@pytest.mark.parametrize(
    "argv",
    [["--lr", "inf"], ["--entropy-coef", "nan"], ["--rollout-temperature", "nan"]],
    ids=lambda a: " ".join(a) if isinstance(a, list) else a,
)
def test_float_flags_refuse_nan_and_inf(capsys, argv):
    line = one_line_error(capsys, ["plan", *argv])
    assert f"argument {argv[0]}: expected a finite number, got '{argv[1]}'" in line, line


TOO_LARGE = [
    (
        ["--over-sampling-batch-size", 10**8],
        "--over-sampling-batch-size 100000000 x --n-samples-per-prompt",
        "of memory, more than this machine's",
    ),
    (
        ["--n-samples-per-eval-prompt", 10**8],
        "--n-samples-per-eval-prompt 100000000 x the",
        "of memory, more than this machine's",
    ),
    (
        ["--lora-rank", 10**8, "--target-modules", "all-linear"],
        "--lora-rank 100000000 is more than the model's hidden_size",
        "use at most",
    ),
    (["--num-threads", 100000], "--num-threads 100000 is more than 4 threads per CPU", "CPU"),
    (["--seed", 2**70], "argument --seed: 1180591620717411303424 does not fit", "64-bit"),
    # every *_timeout flag: seconds a wait can be given (more raised OverflowError mid-run)
    (
        ["--hook-timeout", "1e300"],
        "argument --hook-timeout: expected seconds above 0",
        "longest wait",
    ),
    (
        ["--tool-timeout", "1e300"],
        "argument --tool-timeout: expected seconds above 0",
        "longest wait",
    ),
    (["--rollout-timeout", 2**70], "argument --rollout-timeout: expected seconds", "longest wait"),
    (["--rm-timeout", "0"], "argument --rm-timeout: expected seconds above 0", "got '0'"),
]


@pytest.mark.parametrize(("argv", "flag", "reason"), TOO_LARGE, ids=lambda a: str(a)[:40])
def test_absurd_sizes_are_refused_up_front_with_their_reason(capsys, argv, flag, reason):
    line = one_line_error(capsys, ["plan", *argv])
    assert flag in line and reason in line, line


def test_eval_refuses_more_answers_than_memory_holds(capsys, trained_run):
    argv = ["eval", "--load", trained_run, "--n-samples-per-eval-prompt", 10**8]
    assert main([str(a) for a in argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after eval's note of the model
    assert last.startswith("mileage: error: --n-samples-per-eval-prompt 100000000 x the"), last
    assert "of memory, more than this machine's" in last, last
