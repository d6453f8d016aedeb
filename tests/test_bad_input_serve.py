"""`mileage serve` against bad input: every request field checked in one place (HTTP 400 naming
the field, the connection kept), bodies bounded in size and time, a weight update of another
model refused with the old weights still serving, bad flags refused in one line, and no PEFT
warning on each adapter sync."""

from __future__ import annotations

import http.client
import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

from mileage.cli.main import main
from mileage.models.hf import load_causal_lm
from mileage.serve.server import EngineServer, RequestError, Server, make_handler

PROMPT = [1, 5, 6, 7]


class Wire:
    """An in-process `mileage serve` on a free loopback port (its handler is the real one)."""

    def __init__(self, hf_checkpoint: Path, body_timeout: float):
        self.engine = EngineServer(str(hf_checkpoint), "fp32")
        self.httpd = Server(("127.0.0.1", 0), make_handler(self.engine, body_timeout))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def connect(self) -> http.client.HTTPConnection:
        # every wait bounded: a server that hangs fails the test instead of stalling the suite
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def wire(tiny_hf):
    # a short body timeout, so the test of a body that never arrives waits seconds, not minutes
    server = Wire(tiny_hf, body_timeout=2.0)
    yield server
    server.stop()


def send(
    conn: http.client.HTTPConnection, path: str, body: bytes = b"", headers: dict | None = None
) -> tuple[int, dict]:
    """POST `body` as given, with exactly `headers` (no Content-Length unless in them)."""
    conn.putrequest("POST", path, skip_accept_encoding=True)
    for key, value in (headers or {"Content-Length": str(len(body))}).items():
        conn.putheader(key, value)
    conn.endheaders(body or None)
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read())


def post(conn: http.client.HTTPConnection, path: str, payload: dict) -> tuple[int, dict]:
    return send(conn, path, json.dumps(payload).encode())


GOOD = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "sampling_seed": 1}}

# (request body, what the error must say: the field and what was expected)
BAD_REQUESTS = [
    ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature: expected a finite"),
    ({"sampling_params": {"temperature": float("inf")}}, "temperature: expected a finite number"),
    ({"sampling_params": {"temperature": float("nan")}}, "temperature: expected a finite number"),
    ({"sampling_params": {"temperature": True}}, "temperature: expected a finite number"),
    ({"sampling_params": {"temperature": -0.5}}, "temperature: expected 0 or more"),
    ({"sampling_params": {"top_p": 0}}, "top_p: expected a number in (0, 1]"),
    ({"sampling_params": {"top_p": [1]}}, "top_p: expected a finite number"),
    ({"sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens: expected a positive integer"),
    ({"sampling_params": {"max_new_tokens": True}}, "max_new_tokens: expected a positive integer"),
    ({"sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens: expected a positive integer"),
    ({"sampling_params": {"sampling_seed": True}}, "sampling_seed: expected an integer"),
    ({"sampling_params": {"sampling_seed": 2**64}}, "sampling_seed: expected an integer"),
    ({"sampling_params": {"sampling_seed": "1"}}, "sampling_seed: expected an integer"),
    ({"sampling_params": {"n": True}}, "sampling_params.n: mileage serve supports n=1 only"),
    ({"sampling_params": {"top_k": [1]}}, "top_k: mileage serve supports -1"),
    ({"sampling_params": "greedy"}, "sampling_params: expected a dict"),
    ({"input_ids": [[1], [5]], "sampling_params": {"top_p": "x"}}, "sampling_params.top_p: expe"),
    ({"return_logprob": "yes"}, "return_logprob: expected true or false"),
    ({"input_ids": [True, 5]}, "input_ids[0]: expected a token id"),
    ({"input_ids": [1, 5.0]}, "input_ids[1]: expected a token id"),
    ({"input_ids": [[1, 5], [1, False]]}, "input_ids[1][1]: expected a token id, an integer in"),
    ({"input_ids": [[1, 5], [1, -1]]}, "input_ids[1][1]: expected a token id"),
    ({"input_ids": 5}, "input_ids: expected a non-empty list"),
    ({"input_ids": [[1], []]}, "input_ids[1]: expected a non-empty list of token ids"),
    ({"input_ids": [[1], 5]}, "input_ids[1]: expected a non-empty list of token ids"),
    (
        {
            "input_ids": [[1], [5]],
            "sampling_params": [{"sampling_seed": 1}, {"sampling_seed": 1.5}],
        },
        "sampling_params[1].sampling_seed: expected an integer",
    ),
]


def test_every_bad_request_field_is_refused_naming_the_field(wire, monkeypatch):
    """Issue 34.10, in process: each bad field is a RequestError (HTTP 400) naming the field and
    what was expected; none reaches the engine, none raises anything else."""

    def no_generation(*args, **kwargs):
        pytest.fail("the engine was asked to generate a request that should be refused")

    monkeypatch.setattr(wire.engine.engine, "generate", no_generation)
    wrong = []
    for change, expected in BAD_REQUESTS:
        body = {**GOOD, **change}
        try:
            wire.engine.generate(body)
            wrong.append(f"{change}: accepted")
        except RequestError as exc:
            if expected not in str(exc):
                wrong.append(f"{change}: {exc}")
    assert not wrong, "\n".join(wrong)


def test_bad_requests_and_bodies_get_an_answer_and_the_connection_is_kept(wire):
    """Issue 34.10, on the wire: a wrongly typed field is 400 and the same connection then serves
    a good request; a bad Content-Length or a body that never arrives is answered too."""
    conn = wire.connect()
    status, body = post(conn, "/generate", {**GOOD, "sampling_params": {"temperature": "hot"}})
    assert status == 400 and "sampling_params.temperature" in body["error"], body
    # 1e999 is infinity to Python's json, NaN is not standard JSON
    for text in (b'{"input_ids": [1, 5], "sampling_params": {"temperature": 1e999}}',
                 b'{"input_ids": [1, 5], "sampling_params": {"top_p": NaN}}'):  # fmt: skip
        status, body = send(conn, "/generate", text)
        assert status == 400, body
    status, body = post(conn, "/generate", GOOD)
    assert status == 200 and 1 <= len(body["output_ids"]) <= 3, body
    conn.close()

    for length, want in (("-1", 400), ("ten", 400), (str(1 << 40), 413)):
        conn = wire.connect()
        status, body = send(conn, "/generate", b"", {"Content-Length": length})
        assert status == want and "Content-Length" in body["error"], (length, body)
        conn.close()
    # announced 100 bytes, sent 10: answered once the body timeout is up
    conn = wire.connect()
    status, body = send(conn, "/generate", b'{"input_id', {"Content-Length": "100"})
    assert status == 408 and "10 of its 100 bytes" in body["error"], body
    conn.close()
    conn = wire.connect()
    assert post(conn, "/generate", GOOD)[0] == 200
    conn.close()


@pytest.fixture(scope="module")
def other_models(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    """Models a weight update must not swap in: the served one with a larger vocabulary, and
    another architecture with the same vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config = LlamaConfig.from_pretrained(tiny_hf)
    vocab = config.vocab_size
    out = {"vocab": tmp_path_factory.mktemp("other_vocab"), "arch": tmp_path_factory.mktemp("qwen")}
    torch.manual_seed(1)
    config.vocab_size = vocab + 8
    LlamaForCausalLM(config).save_pretrained(out["vocab"])
    qwen = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=64)  # fmt: skip
    Qwen2ForCausalLM(qwen).save_pretrained(out["arch"])
    return out


def test_a_weight_update_of_another_model_is_refused_and_the_old_weights_serve(
    wire, tiny_hf, other_models
):
    """Issue 34.11: another vocabulary or architecture is 400 naming both values; the server
    keeps its model, path and version, and generates exactly as before."""
    conn = wire.connect()
    status, before = post(conn, "/generate", GOOD)
    assert status == 200, before
    vocab = wire.engine.vocab_size
    refusals = {
        "vocab": f"has vocab_size {vocab + 8}, the served model's is {vocab}",
        "arch": "has architecture Qwen2ForCausalLM, the served model's is LlamaForCausalLM",
    }
    for kind, says in refusals.items():
        payload = {"model_path": str(other_models[kind]), "weight_version": "9"}
        status, body = post(conn, "/update_weights_from_disk", payload)
        assert status == 400 and says in body["error"], body
    assert (wire.engine.model_path, wire.engine.weight_version) == (str(tiny_hf), "default")
    assert post(conn, "/generate", GOOD) == (200, before)
    # the same model still updates
    payload = {"model_path": str(tiny_hf), "weight_version": 3}
    assert post(conn, "/update_weights_from_disk", payload)[1]["success"] is True
    assert wire.engine.weight_version == "3"
    conn.close()


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--port", "99999", "argument --port: 99999 is out of range: give 1..65535"),
        ("--port", "-1", "argument --port: -1 is out of range"),
        ("--num-threads", "0", "argument --num-threads: 0 is out of range: give 1.."),
        ("--num-threads", "1000000", "argument --num-threads: 1000000 is out of range"),
        ("--num-threads", "two", "argument --num-threads: expected a thread count, got 'two'"),
    ],
)
def test_serve_refuses_a_bad_port_or_thread_count_in_one_line(flag, value, says, tmp_path, capsys):
    """Issue 34.12: refused while parsing, before anything is loaded (the checkpoint does not
    even exist: were the flag let through, the error would name the directory instead)."""
    rc = main(["serve", "--hf-checkpoint", str(tmp_path / "none"), flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"mileage: error: {says}"), err


def test_adapter_syncs_raise_no_peft_warning(tiny_hf):
    """Issue 37.8: a LoRA sync loads the new adapter, then unloads the old (the active one):
    PEFT's warning about that is silenced."""
    import peft
    from peft import get_peft_model_state_dict

    from mileage.serve.lora import ServedAdapters

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    with warnings.catch_warnings():  # PEFT asks transformers a deprecated question
        warnings.simplefilter("ignore", FutureWarning)
        trained = peft.get_peft_model(load_causal_lm(tiny_hf), peft.LoraConfig(**config))
    tensors = get_peft_model_state_dict(trained)
    adapters = ServedAdapters()
    served = load_causal_lm(tiny_hf)
    adapters.load(served, "v1", config, tensors, "__tensor__")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for old, new in (("v1", "v2"), ("v2", "v3")):
            with adapters.active(old):
                pass  # a request generated with the old adapter: it is the active one
            adapters.load(served, new, config, tensors, "__tensor__")
            adapters.unload(old)
    assert not [w for w in caught if "was active which is now deleted" in str(w.message)]
    assert list(adapters.paths) == ["v3"]
