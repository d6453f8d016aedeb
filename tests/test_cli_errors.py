"""Bad input: one readable line, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import pytest
from conftest import fast_train_args


@pytest.fixture
def bad_inputs(tmp_path, tiny_hf):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    return {
        "unknown flag": ["--no-such-flag"],
        "bad choice": ["--advantage-estimator", "ppo2"],
        "not a number": ["--rollout-batch-size", "many"],
        "missing prompt file": ["--prompt-data", tmp_path / "missing.jsonl"],
        "missing jsonl key": ["--prompt-data", data],
        "unimportable reward": ["--custom-rm-path", "no_such_module_abc:score"],
        "negative batch": ["--rollout-batch-size", "-4"],
        "zero samples": ["--n-samples-per-prompt", "0"],
        "non-dividing global batch": ["--global-batch-size", "5"],
        "non-dividing micro batch": ["--global-batch-size", "8", "--micro-batch-size", "3"],
        "missing hf checkpoint": ["--hf-checkpoint", tmp_path / "no_model"],
        "bad top-p": ["--rollout-top-p", "1.5"],
        "both num flags": ["--num-rollout", "3", "--num-epoch", "1"],
        "ckpt-step without load": ["--ckpt-step", "0"],
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
        "negative batch",
        "zero samples",
        "non-dividing global batch",
        "non-dividing micro batch",
        "missing hf checkpoint",
        "bad top-p",
        "both num flags",
        "ckpt-step without load",
    ],
)
def test_bad_train_input_is_one_line_exit_2_nothing_written(
    cli, tiny_hf, tmp_path, bad_inputs, case
):
    save = tmp_path / "save"
    result = cli(
        "train", *fast_train_args(tiny_hf), "--num-rollout", 1, "--save", save, *bad_inputs[case]
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), result.stderr
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
