"""Sizes checked against the model, the data and the machine before anything heavy starts.

Without these checks `--rollout-max-response-len 100000000` ended in a traceback (a KV cache of
terabytes), `mileage serve` dropped the connection on `max_new_tokens: 100000000`, and
`--rollout-batch-size 100000000` grew past 10 GB of RAM with no message. Memory-bound cases
derive their sizes from this machine's memory, so they hold on any machine.
"""

from __future__ import annotations

import json
import math
import shutil
import urllib.error
import urllib.request

import pytest
import torch
from conftest import fast_train_args

from mileage.cli.main import main
from mileage.rollout.engine import GENERATION_BATCH
from mileage.rollout.sizes import (
    BYTES_PER_SAMPLE_TOKEN,
    context_length,
    kv_cache_bytes,
    memory_bytes,
    prompt_over,
)
from mileage.serve.server import EngineServer, RequestError
from mileage.testing.servers import start_servers

RAM = memory_bytes(torch.device("cpu"))
TINY_CONTEXT = 64  # max_position_embeddings of the built-in model and of tiny_hf


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"prompt": t, "label": "0"}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def long_context_hf(tiny_hf, tmp_path_factory):
    """tiny_hf claiming a context of 2**40 tokens: only memory can then refuse a length."""
    out = tmp_path_factory.mktemp("long_context_hf")
    shutil.copytree(tiny_hf, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 2**40
    (out / "config.json").write_text(json.dumps(config))
    return out


def refused(capsys, args, save) -> str:
    """Run `mileage train ARGS`; assert one line, exit 2, nothing written; return the line."""
    code = main(["train", *map(str, args), "--num-rollout", "1", "--save", str(save)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), err
    assert not save.exists()
    return lines[0]


def test_response_length_past_the_context_is_refused(capsys, tmp_path, mileage_home):
    # the built-in demo, exactly as the issue tried it
    line = refused(capsys, ["--rollout-max-response-len", 100_000_000], tmp_path / "s")
    assert (
        "--rollout-max-response-len 100000000 does not fit the model's context of 64 tokens "
        "(max_position_embeddings in its config)"
    ) in line


def test_prompt_plus_response_past_the_context_is_refused(capsys, cli, tiny_hf, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ["1+1=", "12+34=" * 10, "2+2=", "3+3="])
    args = [*fast_train_args(tiny_hf), "--prompt-data", data, "--rollout-max-response-len", 8]
    line = refused(capsys, args, tmp_path / "s")
    assert "training prompt 1 of 61 tokens plus --rollout-max-response-len 8 is 69 tokens" in line
    assert "more than the model's context of 64 tokens" in line
    # fits once the response leaves room for the prompt's 61 tokens (BOS + 60 characters)
    ok = cli("train", *args[:-1], 3, "--num-rollout", 1, "--save", tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr


def test_long_evaluation_prompt_is_refused(capsys, tiny_hf, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ["1+1=", "2+2=", "3+3=", "4+4="])
    held_out = write_jsonl(tmp_path / "e.jsonl", ["5+5=", "9" * 70])
    args = [*fast_train_args(tiny_hf), "--prompt-data", data, "--eval-prompt-data", held_out,
            "--eval-interval", 1]  # fmt: skip
    line = refused(capsys, args, tmp_path / "s")
    assert "evaluation prompt 1 of 71 tokens plus --rollout-max-response-len 4" in line
    # its own response length; with several datasets the message names the dataset
    short = write_jsonl(tmp_path / "f.jsonl", ["5+5=", "9" * 40])
    args = [*fast_train_args(tiny_hf), "--prompt-data", data, "--eval-interval", 1,
            "--eval-prompt-data", "a", data, "b", short, "--eval-max-response-len", 30]  # fmt: skip
    line = refused(capsys, args, tmp_path / "s")
    assert "evaluation prompt 1 (dataset b) of 41 tokens plus --eval-max-response-len 30" in line


def test_batch_larger_than_the_data_is_refused(capsys, tiny_hf, tmp_path, mileage_home):
    line = refused(capsys, ["--rollout-batch-size", 100_000_000], tmp_path / "s")
    assert "--rollout-batch-size 100000000 is more than the 9500 prompts" in line
    data = write_jsonl(tmp_path / "d.jsonl", ["1+1=", "2+2=", "3+3="])
    line = refused(capsys, [*fast_train_args(tiny_hf), "--prompt-data", data], tmp_path / "s")
    assert "--rollout-batch-size 4 is more than the 3 prompts of the training data" in line
    assert "use at most 3" in line


def test_samples_that_cannot_fit_in_memory_are_refused(capsys, tmp_path, mileage_home):
    # 16 prompts x n samples of up to 9 tokens: twice this machine's memory
    n = 2 * math.ceil(RAM / (16 * 9 * BYTES_PER_SAMPLE_TOKEN))
    line = refused(capsys, ["--n-samples-per-prompt", n], tmp_path / "s")
    assert f"--rollout-batch-size 16 x --n-samples-per-prompt {n} = {16 * n} samples" in line
    assert "more than this machine's" in line


def test_kv_cache_that_cannot_fit_is_refused(capsys, long_context_hf, tmp_path):
    config = json.loads((long_context_hf / "config.json").read_text())
    rows = 16  # fast_train_args: 4 prompts x 4 samples, generated in one batch
    # long enough that the samples would not fit either: were the KV check missing, the run
    # would still stop before allocating anything (a test must never exhaust the machine)
    length = 2 * RAM // (rows * BYTES_PER_SAMPLE_TOKEN) + 1
    assert kv_cache_bytes(config, rows, length) > RAM
    args = [*fast_train_args(long_context_hf), "--rollout-max-response-len", length - 1]
    line = refused(capsys, args, tmp_path / "s")
    assert f"generating {rows} sequences of up to {length} tokens at once needs a" in line
    assert "KV cache, more than the" in line and "lower --rollout-max-response-len" in line


# --- mileage serve ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_hf):
    (proc,) = start_servers(tiny_hf, 1)
    yield proc
    proc.stop()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_serve_answers_400_with_a_json_error_and_keeps_serving(server):
    # 60 prompt tokens + 8 fit in memory: were the check missing, this would just generate
    status, body = post(
        server.url + "/generate",
        {"input_ids": [[1] + [5] * 59], "sampling_params": {"max_new_tokens": 8}},
    )
    assert status == 400, body
    assert "a prompt of 60 tokens plus max_new_tokens 8 is 68 tokens, more than the model's " \
        "context of 64 tokens" in body["error"]  # fmt: skip
    status, body = post(
        server.url + "/generate",
        {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 3, "sampling_seed": 1}},
    )
    assert status == 200 and len(body["output_ids"]) <= 3


def no_generation(*args, **kwargs):
    pytest.fail("the engine was asked to generate a request that cannot fit")


@pytest.fixture(scope="module")
def checked_only(tiny_hf, long_context_hf):
    """In-process servers whose engine must not be reached: a missing check fails the test
    instead of allocating a cache larger than the machine."""
    servers = {"tiny": EngineServer(str(tiny_hf)), "long": EngineServer(str(long_context_hf))}
    for server in servers.values():
        server.engine.generate = no_generation
    return servers


def test_serve_refuses_max_new_tokens_past_the_context(checked_only):
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 100_000_000}}
    with pytest.raises(RequestError, match="max_new_tokens 100000000 does not fit the model's "
                       "context of 64 tokens"):  # fmt: skip
        checked_only["tiny"].generate(body)


def test_serve_refuses_a_kv_cache_that_cannot_fit(checked_only):
    server = checked_only["long"]
    rows = 3
    max_new = 2 * RAM // kv_cache_bytes(server.model_config, rows, 1)
    body = {"input_ids": [[1, 5]] * rows, "sampling_params": {"max_new_tokens": max_new}}
    with pytest.raises(RequestError, match=f"generating {rows} sequences of up to"):
        server.generate(body)
    # the batch a request is generated in is at most the engine's: more rows need no more cache
    limit = RAM // kv_cache_bytes(server.model_config, GENERATION_BATCH, 1)
    server._check_sizes([[1]] * (GENERATION_BATCH * 4), limit // 2)


# --- the helpers -----------------------------------------------------------------------------


def test_context_length_reads_the_architectures_key():
    assert context_length({"max_position_embeddings": 2048}) == 2048
    assert context_length({"n_positions": 1024}) == 1024  # GPT-2
    assert context_length({"hidden_size": 8}) is None  # unknown: not checked


def test_prompt_over_encodes_only_prompts_that_may_be_too_long():
    encoded = []

    def encode(text: str) -> list[int]:  # one token per character, plus a BOS
        encoded.append(text)
        return [0] * (len(text) + 1)

    texts = ["a" * 5, "b" * 100, "c" * 30, "d" * 101]
    assert prompt_over(texts, encode, 200) is None
    assert encoded == [""]  # no prompt can reach 200 tokens: none was encoded
    encoded.clear()
    assert prompt_over(texts, encode, 100) == (3, 102)
    assert "a" * 5 not in encoded and "c" * 30 not in encoded
    assert prompt_over(texts, encode, 102) is None
    # 100 bytes, 101 tokens (the BOS the tokenizer adds): over a limit of 100
    assert prompt_over(["x" * 100], encode, 100) == (0, 101)
