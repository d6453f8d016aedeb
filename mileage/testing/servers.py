"""`mileage serve` processes for tests and scripts: started on a free loopback port in their
own process group, stopped by that group, every wait bounded."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_LISTENING = re.compile(r"listening on (http://\S+)")
# `mileage serve` flags that make a server's arithmetic the trainer's in bf16: the trainer's LM
# head is bf16, and a server's default fp32 head alone puts the log-probs ~1e-2 apart
# (models/lm_head.py). Servers whose samples a test compares with a trainer's use them.
SAME_HEAD_AS_TRAINER = ("--no-fp32-lm-head",)


class ServeProcess:
    """One `mileage serve --port 0`; `url` is known once it listens."""

    def __init__(
        self,
        hf_checkpoint: str | Path,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        cores: str | None = None,
    ):
        """`cores`: pin the server to these CPUs (`taskset -c`), as benchmarks do."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("MILEAGE_KILL_AT", None)
        pin = ["taskset", "-c", cores] if cores else []
        self.proc = subprocess.Popen(
            [
                *pin,
                sys.executable,
                "-m",
                "mileage",
                "serve",
                "--hf-checkpoint",
                str(hf_checkpoint),
                "--port",
                "0",
                "--num-threads",
                "1",
                *args,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,  # its own process group: stopped as a whole, never by name
        )
        self.output: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            match = _LISTENING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> str:
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"mileage serve did not start: {''.join(self.output)[-2000:]}")
        return self.url

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_servers(
    hf_checkpoint: str | Path,
    count: int,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    cores: str | None = None,
) -> list[ServeProcess]:
    """`count` servers started at once (their start-up overlaps), each ready or raising;
    `args` are extra `mileage serve` flags (e.g. `--dtype float32`), `cores` pins them."""
    servers = [ServeProcess(hf_checkpoint, env, args, cores) for _ in range(count)]
    deadline = time.monotonic() + 180
    try:
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except RuntimeError:
        for server in servers:
            server.stop()
        raise
    return servers


class FakeSGLang:
    """An in-process stand-in for an SGLang server, for tests and benchmarks of the client.

    `/get_server_info` answers `info` (SGLang's field names); `/update_weights_from_disk`
    accepts any path and takes the version; `/generate` answers after `latency` seconds (times
    a factor in [0.5, 1.5) drawn from the request's first seed, so concurrent replies come back
    out of order) with tokens drawn from each row's `sampling_seed` alone: the same request
    always gets the same reply. Requests are served concurrently, as SGLang batches them;
    `max_in_flight` records how many were in flight at once.
    """

    def __init__(self, info: dict | None = None, latency: float = 0.0, vocab_size: int = 50):
        import json
        import random
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.info = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "dtype": "auto",
                     "enable_deterministic_inference": True, **(info or {})}  # fmt: skip
        self.latency = latency
        self.weight_version = "default"
        self.in_flight = 0
        self.max_in_flight = 0
        self.generate_calls = 0
        self._lock = threading.Lock()
        fake = self

        def sample(prompt: list[int], params: dict) -> dict:
            rng = random.Random(params.get("sampling_seed", 0) * 7919 + sum(prompt))
            n = int(params.get("max_new_tokens", 4))
            tokens = [rng.randrange(vocab_size) for _ in range(n)]
            pairs = [[-rng.random() - 1e-3, t, None] for t in tokens]
            meta = {"output_token_logprobs": pairs, "finish_reason": {"type": "length"},
                    "weight_version": fake.weight_version}  # fmt: skip
            return {"output_ids": tokens, "meta_info": meta}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's name
                pass

            def _send(self, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({**fake.info, "weight_version": fake.weight_version})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/update_weights_from_disk":
                    fake.weight_version = str(body.get("weight_version", fake.weight_version))
                    self._send({"success": True, "message": "ok", "num_paused_requests": 0})
                    return
                with fake._lock:
                    fake.in_flight += 1
                    fake.generate_calls += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                params = body["sampling_params"]
                first = params[0].get("sampling_seed", 0) if params else 0
                time.sleep(fake.latency * (0.5 + random.Random(first).random()))
                replies = [sample(p, q) for p, q in zip(body["input_ids"], params, strict=True)]
                with fake._lock:
                    fake.in_flight -= 1
                self._send(replies)

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # many connections at once (the stdlib's backlog is 5)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
