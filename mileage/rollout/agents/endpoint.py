"""The OpenAI-compatible HTTP endpoint a run's agents call: one server on 127.0.0.1, started
with the first agent rollout and stopped with the run.

Each sample gets its own key; its agent is handed `base_url = http://127.0.0.1:PORT/s/KEY/v1`
and `api_key = KEY`, and a request is attributed by either (the path first), so an agent
framework that fixes its API key, or one that fixes its URL, still reaches its own sample:

    POST /v1/chat/completions   chat messages -> the assistant's answer (tool calls included)
    POST /v1/completions        a prompt (text or token ids) -> its continuation
    GET  /v1/models             the one model: the policy being trained

Replies are OpenAI's shapes, streamed as server-sent events when asked (`"stream": true`).
The server runs a thread per connection; what a request does is the sample's (`session`).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from mileage.rollout.agents.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    Request,
    chunks,
    models,
    parse_request,
    reply,
)

MODEL_NAME = "mileage-policy"
BODY_TIMEOUT_S = 60.0  # a body must arrive within this (a stalled client gets 408)


class Sample(Protocol):
    """What the endpoint needs of a sample: answer a checked request, or raise ApiError."""

    def handle(self, request: Request) -> tuple[list[Any], list[int]]: ...


class AgentEndpoint:
    """The endpoint (module docstring): a key per live sample, the server in a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, Sample] = {}
        self._ended: deque[str] = deque(maxlen=1 << 16)  # recently ended keys: 409, not 401
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        self.start()
        assert self._server is not None
        return self._server.server_address[1]

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            self._server = _Server(("127.0.0.1", 0), _handler(self))
            self._server.daemon_threads = True
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="mileage agent endpoint", daemon=True
            )
            self._thread.start()

    def add(self, sample: Sample) -> tuple[str, str]:
        """A new key for `sample`: its (base_url, api_key)."""
        key = "mileage-" + secrets.token_hex(12)
        with self._lock:
            self._samples[key] = sample
        return f"http://127.0.0.1:{self.port}/s/{key}/v1", key

    def remove(self, key: str) -> None:
        with self._lock:
            if self._samples.pop(key, None) is not None:
                self._ended.append(key)

    def lookup(self, key: str | None) -> Sample:
        with self._lock:
            sample = self._samples.get(key) if key else None
            ended = key in self._ended
        if sample is None:
            if ended:
                raise ApiError("this sample's rollout has ended; its key is closed", 409)
            raise ApiError("unknown API key: use the base_url and api_key the run gave", 401)
        return sample

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _Server(ThreadingHTTPServer):
    # every agent of a rollout (an evaluation's hundreds) may connect at once: the stdlib's
    # backlog of 5 would refuse the rest (the kernel caps it at net.core.somaxconn)
    request_queue_size = 4096


def _key_and_route(path: str, authorization: str | None) -> tuple[str | None, str]:
    """(the sample's key, the route under /v1) of a request path."""
    path = path.split("?", 1)[0]
    key = None
    if path.startswith("/s/"):
        key, _, rest = path[3:].partition("/")
        path = "/" + rest
    if key is None and authorization and authorization.lower().startswith("bearer "):
        key = authorization[7:].strip()
    return key, path


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "mileage-agent-endpoint"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
            return  # one line per request would drown the run's own output

        def _send(self, status: int, body: dict[str, Any], close: bool = False) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _error(self, exc: ApiError, close: bool = False) -> None:
            self._send(exc.status, exc.body(), close)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            _, route = _key_and_route(self.path, self.headers.get("Authorization"))
            if route in ("/v1/models", "/models"):
                self._send(200, models(MODEL_NAME))
            else:
                self._error(ApiError(f"no route GET {route}", 404))

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            key, route = _key_and_route(self.path, self.headers.get("Authorization"))
            chat = route in ("/v1/chat/completions", "/chat/completions")
            if not chat and route not in ("/v1/completions", "/completions"):
                self._error(ApiError(f"no route POST {route}", 404), close=True)
                return
            try:
                raw = self._body()
            except ApiError as exc:
                self._error(exc, close=True)  # the stream is at an unknown place
                return
            try:
                sample = endpoint.lookup(key)
                request = parse_request(raw, chat)
                answers, prompt_ids = sample.handle(request)
            except ApiError as exc:
                self._error(exc)
                return
            ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)
            if not request.stream:
                self._send(200, reply(request, answers, prompt_ids, ident))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in chunks(request, answers, prompt_ids, ident):
                self._chunk(f"data: {json.dumps(event)}\n\n".encode())
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raise ApiError("send the body with a Content-Length (not chunked)", 411)
            if length is None:
                return b""
            try:
                size = int(length)
            except ValueError:
                raise ApiError(f"Content-Length {length!r} is not a number") from None
            if size > MAX_BODY_BYTES:
                raise ApiError(
                    f"the body is {size} bytes; the endpoint takes at most {MAX_BODY_BYTES}", 413
                )
            self.connection.settimeout(BODY_TIMEOUT_S)
            try:
                data = self.rfile.read(size)
            except TimeoutError:
                raise ApiError("the body did not arrive in time", 408) from None
            finally:
                self.connection.settimeout(None)
            if len(data) != size:
                raise ApiError("the body ended before its Content-Length", 400)
            return data

    return Handler
