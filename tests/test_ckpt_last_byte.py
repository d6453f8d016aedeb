"""Damage past the first read chunk of a checkpoint file is found by `ckpt verify` and a resume.

Checksums are computed chunk by chunk (`checkpoint/files.py`, 4 MiB reads). A flipped byte
inside the first chunk says nothing about the chunks after it, so these tests flip the last
byte of files larger than one chunk, in a single-process checkpoint.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import fast_train_args, run_cli
from transformers import LlamaForCausalLM

from mileage.models.tiny import build_char_tokenizer, tiny_llama_config
from mileage.rollout.tasks import builtin_alphabet

READ_CHUNK = 1 << 22  # file_sha256's read size


@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory):
    """A 2-layer Llama of hidden size 256: its weights (8 MiB in fp32) span two read chunks."""
    out = tmp_path_factory.mktemp("wide_hf")
    tok = build_char_tokenizer(builtin_alphabet())
    config = tiny_llama_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id,
                               hidden=256, layers=2, heads=4, intermediate=1024)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trained(wide_hf, tmp_path_factory, mileage_home):
    save = tmp_path_factory.mktemp("wide_run") / "save"
    args = ["train", *fast_train_args(wide_hf), "--save", save, "--num-rollout", 1]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    return save


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_last_byte_of_a_large_shard_is_caught_by_verify_and_resume(
    cli, wide_hf, trained, tmp_path, part
):
    save = tmp_path / "save"
    shutil.copytree(trained, save)
    (checkpoint,) = sorted(save.glob("iter_*"))
    shard = max((checkpoint / part).rglob("*.distcp"), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > READ_CHUNK  # the damage lies past the first chunk
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))

    verify = cli("ckpt", "verify", save)
    lines = verify.stderr.strip().splitlines()
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert len(lines) == 1 and lines[0].startswith("CORRUPT ") and str(shard) in lines[0]
    assert "Traceback" not in verify.stderr

    resume = cli("train", *fast_train_args(wide_hf), "--save", save, "--load", save,
                 "--num-rollout", 2)  # fmt: skip
    lines = resume.stderr.strip().splitlines()
    assert resume.returncode == 2, resume.stderr
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), resume.stderr
    assert f"{checkpoint.name} is corrupt" in lines[0] and "checksum mismatch" in lines[0]
    assert shard.read_bytes() == bytes(data)  # refused, and left as it was
    assert not (save / "iter_0000001").exists()
