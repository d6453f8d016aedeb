"""Bad input: one readable line naming the problem, exit code 2, no traceback, nothing written.

Each case asserts its own message, so a check that is missing cannot hide behind a later,
unrelated one that happens to exit 2 as well.
"""

from __future__ import annotations

import re

import pytest
from conftest import fast_train_args

from mileage.cli.main import build_parser, main

# every count or length flag: zero and negative are refused by their own check
POSITIVE_FLAGS = [
    "--rollout-batch-size",
    "--n-samples-per-prompt",
    "--rollout-max-response-len",
    "--num-threads",
    "--num-rollout",
    "--num-epoch",
    "--debug-exit-after-rollout",
    "--save-interval",
    "--save-keep-last",
    "--global-batch-size",
    "--micro-batch-size",
    "--lr-decay-iters",
    "--n-samples-per-eval-prompt",
    "--eval-max-response-len",
]
NON_NEGATIVE_FLAGS = [
    "--eval-interval",
    "--start-rollout-id",
    "--ckpt-step",
    "--ref-ckpt-step",
    "--rollout-temperature",
    "--lr",
    "--min-lr",
    "--lr-warmup-iters",
    "--weight-decay",
    "--adam-eps",
    "--clip-grad",
    "--eval-temperature",
]
LIMIT_CASES = {
    **{f"{flag} 0": ([flag, "0"], f"{flag} must be positive, got 0") for flag in POSITIVE_FLAGS},
    **{f"{flag} -3": ([flag, "-3"], f"{flag} must be positive, got -3") for flag in POSITIVE_FLAGS},
    **{f"{flag} -1": ([flag, "-1"], f"{flag} must be >= 0, got -1") for flag in NON_NEGATIVE_FLAGS},
    "--adam-beta1 1": (["--adam-beta1", "1"], "--adam-beta1 must be in [0, 1), got 1.0"),
    "--adam-beta2 -0.1": (["--adam-beta2", "-0.1"], "--adam-beta2 must be in [0, 1), got -0.1"),
    "--rollout-top-p 1.5": (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1]"),
    "--rollout-top-p 0": (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1]"),
    "--eval-top-p 1.5": (["--eval-top-p", "1.5"], "--eval-top-p must be in (0, 1]"),
}


@pytest.mark.parametrize("case", sorted(LIMIT_CASES))
def test_every_limit_has_its_own_one_line_error(tiny_hf, tmp_path, capsys, case):
    extra, message = LIMIT_CASES[case]
    save = tmp_path / "save"
    args = [*fast_train_args(tiny_hf), "--num-rollout", "1", "--save", str(save)]
    code = main(["train", *map(str, args), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: ") and message in lines[0], err
    assert not save.exists()


@pytest.fixture
def bad_inputs(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    return {
        "unknown flag": (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        "bad choice": (["--advantage-estimator", "ppo2"], "invalid choice: 'ppo2'"),
        "not a number": (["--rollout-batch-size", "many"], "invalid int value: 'many'"),
        "missing prompt file": (
            ["--prompt-data", tmp_path / "missing.jsonl"],
            "prompt file not found",
        ),
        "missing jsonl key": (["--prompt-data", data], "data.jsonl:1: missing key 'prompt'"),
        "unimportable reward": (
            ["--custom-rm-path", "no_such_module_abc:score"],
            "--custom-rm-path: cannot import 'no_such_module_abc'",
        ),
        "grpo with one sample": (
            ["--n-samples-per-prompt", "1"],
            "grpo needs --n-samples-per-prompt >= 2",
        ),
        "non-dividing global batch": (
            ["--global-batch-size", "5"],
            "--global-batch-size 5 does not divide the 16 samples",
        ),
        "non-dividing micro batch": (
            ["--global-batch-size", "8", "--micro-batch-size", "3"],
            "--micro-batch-size 3 does not divide --global-batch-size 8",
        ),
        "missing hf checkpoint": (
            ["--hf-checkpoint", tmp_path / "no_model"],
            "no_model does not exist; --hf-checkpoint must be a Hugging Face model directory",
        ),
        "both num flags": (
            ["--num-rollout", "3", "--num-epoch", "1"],
            "give --num-rollout or --num-epoch, not both",
        ),
        "ckpt-step without load": (
            ["--ckpt-step", "0"],
            "--ckpt-step selects a checkpoint under --load; --load is not set",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown flag",
        "bad choice",
        "not a number",
        "missing prompt file",
        "missing jsonl key",
        "unimportable reward",
        "grpo with one sample",
        "non-dividing global batch",
        "non-dividing micro batch",
        "missing hf checkpoint",
        "both num flags",
        "ckpt-step without load",
    ],
)
def test_bad_train_input_is_one_line_exit_2_nothing_written(
    cli, tiny_hf, tmp_path, bad_inputs, case
):
    extra, message = bad_inputs[case]
    save = tmp_path / "save"
    result = cli("train", *fast_train_args(tiny_hf), "--num-rollout", 1, "--save", save, *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert not save.exists()


def test_corrupt_checkpoint_is_refused_and_left_alone(cli, tiny_hf, tmp_path):
    save = tmp_path / "save"
    args = ["train", *fast_train_args(tiny_hf), "--save", save, "--load", save]
    assert cli(*args, "--num-rollout", 2, "--save-interval", 1).returncode == 0
    shard = next((save / "iter_0000001" / "model").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = cli(*args, "--num-rollout", 4)
    assert result.returncode == 2
    assert "iter_0000001 is corrupt" in result.stderr and "checksum mismatch" in result.stderr
    assert shard.read_bytes() == bytes(data) and (save / "iter_0000000").is_dir()
    verify = cli("ckpt", "verify", save)
    assert verify.returncode == 1 and str(shard) in verify.stderr
    older = cli(*args, "--num-rollout", 4, "--ckpt-step", 0)
    assert older.returncode == 0, older.stderr  # the previous good checkpoint still works


def test_a_flag_of_train_async_given_to_train_names_the_command_that_takes_it(capsys):
    assert main(["train", "--fully-async"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "mileage: error: unrecognized arguments: --fully-async (--fully-async is a flag of "
        "`mileage train-async`; run `mileage train-async ...`)"
    )
    assert main(["train", "--no-such-flag"]) == 2
    assert "--no-such-flag (see `mileage train --help`)" in capsys.readouterr().err


def test_eval_help_lists_the_flags_evaluation_reads_and_eval_takes_trains_flags(capsys):
    from mileage.cli.eval_command import eval_flags

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    listed = set(re.findall(r"^  (--[a-z0-9-]+)", capsys.readouterr().out, re.MULTILINE))
    assert listed == eval_flags() | {"--json"}
    assert {"--eval-prompt-data", "--load", "--rollout-engine", "--seed"} <= listed
    assert not {"--lr", "--save-interval", "--global-batch-size", "--lora-rank"} & listed
    # a training command's flags still parse: its user functions see them as in training
    args = build_parser().parse_args(["eval", "--lr", "0.5", "--save-interval", "2"])
    assert (args.lr, args.save_interval) == (0.5, 2)


def test_custom_loss_takes_the_file_form_of_the_other_hooks(tmp_path, capsys):
    from mileage.training.algo import AlgoConfig, load_custom_loss

    path = tmp_path / "my_loss.py"
    path.write_text("def loss(algo, batch, logprobs, reduce):\n    return reduce(logprobs), {}\n")
    AlgoConfig(loss_type="custom_loss", custom_loss_function_path=f"{path}:loss").validate(4)
    assert callable(load_custom_loss(f"{path}:loss"))
    flags = ["--loss-type", "custom_loss", "--custom-loss-function-path", f"{path}:nope"]
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert f"--custom-loss-function-path: '{path}' has no function 'nope'" in err, err
