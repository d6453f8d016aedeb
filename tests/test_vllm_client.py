"""The vLLM client against servers of other versions (fake endpoints in this process): an empty
2xx body is a success, a server without the 0.32 weight endpoints or without dev mode stops the
run with one line naming what is needed, and the CPU-only launch flags apply only on the CPU."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mileage.errors import UserError
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.vllm import VLLMEngine
from mileage.rollout.engines.vllm_server import launch_args, runs_on_cpu

OK = (200, b'{"success": true}')


class FakeEndpoints:
    """POST path -> (status, body); GET /version answers `version`."""

    def __init__(self, routes: dict[str, tuple[int, bytes]], version: str = "0.31.1"):
        self.calls: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200, json.dumps({"version": version}).encode())

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.calls.append(self.path)
                self._send(*routes.get(self.path, (404, b'{"detail": "Not Found"}')))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def load_on(routes, tmp_path, version="0.31.1"):
    fake = FakeEndpoints(routes, version)
    cfg = EngineConfig(rollout_engine="vllm", rollout_url=[fake.url], rollout_attempts=1,
                       rollout_sync_timeout=10.0, rollout_weights_dir=str(tmp_path / "w"))  # fmt: skip
    engine = VLLMEngine(cfg, vocab_size=50, eos_id=2, model_dir="unused", log=print)
    try:
        engine._load(tmp_path / "weights", 3)
        return engine, fake.calls
    finally:
        engine.close()
        fake.stop()


def test_an_empty_2xx_body_is_a_success(tmp_path):
    routes = {"/collective_rpc": (200, b'{"results": [null]}'), "/reset_prefix_cache": (200, b""),
              "/update_weight_version": OK}  # fmt: skip
    engine, calls = load_on(routes, tmp_path)
    assert engine.weight_version == 3 and engine.pool.excluded == set()
    assert calls == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]


def test_no_update_weight_version_names_the_minimum_vllm(tmp_path):
    routes = {"/collective_rpc": (200, b'{"results": [null]}'), "/reset_prefix_cache": (200, b"")}
    with pytest.raises(UserError) as failed:
        load_on(routes, tmp_path, version="0.30.2")
    message = str(failed.value)
    assert "has no /update_weight_version: mileage needs vLLM 0.32 or newer" in message
    assert "reports version 0.30.2" in message and "\n" not in message


@pytest.mark.parametrize(
    "error",
    [
        b"reload_weights() got an unexpected keyword argument 'weights_path'",
        b"'Worker' object has no attribute 'reload_weights'",
    ],
)
def test_a_reload_without_weights_path_names_the_minimum_vllm(tmp_path, error):
    routes = {"/collective_rpc": (500, b'{"error": "' + error.replace(b"'", b"\\u0027") + b'"}')}
    with pytest.raises(UserError, match=r"has no reload_weights\(weights_path=...\): mileage "
                                        r"needs vLLM 0.32 or newer"):  # fmt: skip
        load_on(routes, tmp_path)


def test_no_dev_mode_names_the_variable(tmp_path):
    with pytest.raises(UserError, match="start it with VLLM_SERVER_DEV_MODE=1"):
        load_on({}, tmp_path)


def test_an_ordinary_failure_is_still_a_failed_sync_not_a_version_error(tmp_path):
    routes = {"/collective_rpc": (500, b'{"error": "out of memory"}'),
              "/reset_prefix_cache": OK, "/update_weight_version": OK}  # fmt: skip
    with pytest.raises(UserError, match="no server loaded the weights of version 3"):
        load_on(routes, tmp_path)


def test_cpu_launch_flags_only_on_the_cpu():
    assert launch_args("", on_cpu=False) == [
        "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
    ]  # fmt: skip
    assert launch_args("--gpu-memory-utilization 0.5", on_cpu=False)[-2:] == [
        "--gpu-memory-utilization", "0.5",
    ]  # fmt: skip
    on_cpu = launch_args("", on_cpu=True)
    for flag in ("--enforce-eager", "--kv-cache-memory-bytes"):
        assert flag in on_cpu


def test_the_launch_is_on_the_cpu_when_its_torch_sees_no_gpu(tmp_path, monkeypatch):
    import torch

    # this machine's Python: its torch sees a GPU exactly when this process's does
    assert runs_on_cpu(sys.executable) is (not torch.cuda.is_available())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runs_on_cpu(sys.executable) is True
    with pytest.raises(UserError, match="cannot run it"):
        runs_on_cpu(tmp_path / "missing-python")
