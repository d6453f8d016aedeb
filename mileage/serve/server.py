"""`mileage serve`: the in-process engine behind SGLang's native HTTP API.

Endpoints (the SGLang request and reply shapes, the subset mileage uses):
- `GET /health`: 200 once the model is loaded.
- `GET /get_model_info`: `model_path` and `weight_version`.
- `POST /generate`: `input_ids` (one list of token ids, or a batch of them), `sampling_params`
  (one dict, or one per row: `max_new_tokens`, `temperature`, `top_p`, `sampling_seed`),
  `return_logprob`. Reply per row: `output_ids`, `text` and `meta_info` with
  `output_token_logprobs` (`[log-prob, token id, null]` per token), `finish_reason`
  (`{"type": "stop", "matched": eos}` or `{"type": "length", "length": n}`), `prompt_tokens`,
  `completion_tokens` and `weight_version`. With `max_new_tokens` 0, `return_logprob` and
  `logprob_start_len`: the given tokens' log-probs instead (`mileage/serve/scoring.py`).
- LoRA adapters (SGLang's `/load_lora_adapter`, `/load_lora_adapter_from_tensors`,
  `/unload_lora_adapter`, `/update_weight_version`, and `lora_path` in `/generate`):
  `mileage/serve/lora.py`.
- `POST /update_weights_from_disk`: `model_path` (an HF directory), optional `weight_version`;
  replies `{"success", "message", "num_paused_requests"}`.
- `GET /get_server_info`: SGLang's fields that clients read: `tp_size`, `pp_size`, `dp_size`
  (1 each), `dtype` (the weights'), `enable_deterministic_inference` (true: seeds are honoured),
  `model_path`, `weight_version`.
- `POST /init_weights_update_group` and `POST /update_weights_from_distributed`: SGLang's
  weight transfer over a collective, in buckets: `mileage/serve/broadcast.py`.

Every field of a request is checked before the server acts on it (`mileage/serve/requests.py`):
a request it cannot take gets HTTP 400 with `{"error": "<field>: expected ..."}`, and a body that
is too large (413) or does not arrive (408) is answered too, within a bound.

Requests run one at a time, with a fixed thread count and deterministic algorithms, and a row
with a `sampling_seed` draws from its own generator seeded with it: its sample is a function of
(weights, prompt, params, seed) alone, so a resumed run through `mileage serve` reproduces an
uninterrupted one bit for bit, whichever server serves which request.

`MILEAGE_SERVE_FAULT=<die|hang|garbage>:<n>` makes the n-th `/generate` request kill the server
(SIGKILL), stop it (SIGSTOP, a hang) or answer garbage: the fault tests use it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from mileage.errors import UserError
from mileage.models.hf import load_causal_lm, load_tokenizer
from mileage.precision import BF16, FP32, resolve, set_precision, torch_dtype_name
from mileage.rollout.engine import Completion, LocalEngine
from mileage.rollout.sizes import kv_cache_problem, length_problem
from mileage.seeding import configure_determinism
from mileage.serve.broadcast import BroadcastEndpoints
from mileage.serve.lora import AdapterEndpoints
from mileage.serve.requests import (
    BODY_TIMEOUT_S,
    BodyError,
    RequestError,
    parse_generate,
    parse_weight_update,
    read_json_body,
    version_label,
)
from mileage.serve.scoring import ScoringRequest, parse_scoring, score_rows

__all__ = ["EngineServer", "RequestError", "Server", "make_handler", "register", "serve"]

# `--dtype` as vLLM and SGLang spell it -> mileage's precision names
DTYPES = {"auto": "auto", "float32": FP32, "bfloat16": BF16}


class EngineServer:
    def __init__(
        self,
        hf_checkpoint: str,
        precision: str = FP32,
        enable_lora: bool = False,
        fp32_lm_head: bool = True,
    ):
        self.lock = threading.Lock()
        # every model it serves (the first and each reload) computes in this precision
        self.precision, self.fp32_lm_head = precision, fp32_lm_head
        self.model_path = str(hf_checkpoint)
        self.tokenizer = load_tokenizer(hf_checkpoint)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        model = set_precision(load_causal_lm(hf_checkpoint), precision, fp32_lm_head)
        self.engine = LocalEngine(model, pad, eos)
        self.weight_version = "default"
        self.vocab_size = self.engine.model.config.vocab_size
        self.architecture = type(model).__name__
        self.model_config = self.engine.model.config.to_dict()
        self.generate_count = 0
        self.broadcast = BroadcastEndpoints(self)
        self.lora = AdapterEndpoints(self, enable_lora)
        kind, _, count = os.environ.get("MILEAGE_SERVE_FAULT", "").partition(":")
        self.fault = (kind, int(count)) if kind else None

    def update_weights(self, body: dict) -> dict:
        path, version = parse_weight_update(body)
        with self.lock:
            try:
                model = load_causal_lm(path)
            except UserError as exc:
                return {"success": False, "message": str(exc), "num_paused_requests": 0}
            self._refuse_another_model(path, model)
            self.lora.adapters.reset()  # they were injected into the model being replaced
            self.engine.update_weights(set_precision(model, self.precision, self.fp32_lm_head))
            self.model_path = path
            self.model_config = model.config.to_dict()  # its context, for the length checks
            if version is not None:
                self.weight_version = version
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    def _refuse_another_model(self, path: str, model: torch.nn.Module) -> None:
        """New weights must be the served model's: the tokenizer (token ids in, text out) and
        the vocabulary checks of requests stay, so another vocabulary would make every later
        request fail or decode wrong. Refused, the old weights keep serving."""
        for what, served, new in (
            ("vocab_size", self.vocab_size, model.config.vocab_size),
            ("architecture", self.architecture, type(model).__name__),
        ):
            if new != served:
                raise RequestError(
                    f"model_path: {path} has {what} {new}, the served model's is {served}; "
                    f"a weight update keeps the model, so start a server for the other one"
                )

    def update_weight_version(self, body: dict) -> dict:
        version = version_label(body.get("new_version"), "new_version")
        with self.lock:
            self.weight_version = version
        return {"success": True, "message": f"weight version {self.weight_version}"}

    def server_info(self) -> dict:
        """SGLang's fields that clients read: one worker, the weights' dtype, and seeds that are
        honoured (a row's sample is a function of its seed; SGLang needs
        --enable-deterministic-inference for that)."""
        dtype = next(self.engine.model.parameters()).dtype
        return {
            "model_path": self.model_path,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "dtype": str(dtype).removeprefix("torch."),
            "enable_deterministic_inference": True,
            "weight_version": self.weight_version,
            "version": "mileage-serve",
            # adapters of any rank on any linear layer (SGLang: --enable-lora)
            "enable_lora": self.lora.enabled,
            "max_lora_rank": None,
            "lora_target_modules": None,
        }

    def generate(self, body: dict) -> dict | list:
        scoring = parse_scoring(body, self.vocab_size)
        if scoring is not None:  # max_new_tokens 0: the log-probs of the given tokens
            return self._score(scoring)
        request = parse_generate(body, self.vocab_size)
        rows, params, adapter = request.rows, request.params, request.adapter
        self._check_sizes(rows, params.max_new_tokens)
        seeds = request.seeds
        if seeds is None:
            generators = torch.Generator().manual_seed(torch.seed())
        else:
            generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        with self.lock:
            self.generate_count += 1
            self._maybe_fail()
            with self.lora.adapters.active(adapter):
                completions = self.engine.generate(rows, params, generators)
            version = self.weight_version
        outputs = [self._output(c, version) for c in completions]
        if self.fault and self.fault[0] == "garbage" and self.generate_count >= self.fault[1]:
            outputs = [{"meta_info": {"output_token_logprobs": "garbage"}} for _ in outputs]
        return outputs[0] if request.single else outputs

    def _score(self, request: ScoringRequest) -> dict | list:
        self._check_sizes(request.rows, 0)
        with self.lock:
            self.generate_count += 1
            self._maybe_fail()
            outputs = score_rows(self.engine.model, request)
        if self.fault and self.fault[0] == "garbage" and self.generate_count >= self.fault[1]:
            outputs = [{"meta_info": {"input_token_logprobs": "garbage"}} for _ in outputs]
        return outputs[0] if request.single else outputs

    def _check_sizes(self, rows: list[list[int]], max_new_tokens: int) -> None:
        """Refuse before generating what cannot fit the context or the device's memory (SGLang
        answers such requests with 400 too)."""
        longest = max(len(r) for r in rows)
        problem = length_problem(self.model_config, longest, max_new_tokens, "max_new_tokens")
        if problem is None:
            weights = next(self.engine.model.parameters())
            batch = min(len(rows), self.engine.max_batch_size)
            problem = kv_cache_problem(
                self.model_config,
                batch,
                longest + max_new_tokens,
                weights.device,
                weights.element_size(),
            )
        if problem:
            raise RequestError(problem)

    def _maybe_fail(self) -> None:
        if not self.fault or self.generate_count != self.fault[1]:
            return
        if self.fault[0] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault[0] == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)

    def _output(self, c: Completion, version: str) -> dict:
        finish = (
            {"type": "stop", "matched": self.engine.eos_id}
            if c.finished
            else {"type": "length", "length": len(c.response_ids)}
        )
        return {
            "text": self.tokenizer.decode(c.response_ids, skip_special_tokens=True),
            "output_ids": c.response_ids,
            "meta_info": {
                "finish_reason": finish,
                "prompt_tokens": len(c.prompt_ids),
                "completion_tokens": len(c.response_ids),
                "cached_tokens": 0,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(c.logprobs, c.response_ids, strict=True)
                ],
                "weight_version": version,
            },
        }


def make_handler(server: EngineServer, body_timeout: float = BODY_TIMEOUT_S):
    """The HTTP side; `body_timeout`: seconds a request's whole body may take to arrive."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's name
            pass  # one line per request would drown the output

        def _send(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout, or it was killed)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/get_server_info":
                self._send(200, server.server_info())
            elif self.path == "/get_model_info":
                self._send(
                    200,
                    {"model_path": server.model_path, "weight_version": server.weight_version},
                )
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            routes = {
                "/generate": server.generate,
                "/update_weights_from_disk": server.update_weights,
                "/init_weights_update_group": server.broadcast.init_group,
                "/update_weights_from_distributed": server.broadcast.update,
                "/update_weight_version": server.update_weight_version,
                "/load_lora_adapter": server.lora.load_from_disk,
                "/load_lora_adapter_from_tensors": server.lora.load_from_tensors,
                "/unload_lora_adapter": server.lora.unload,
            }
            route = routes.get(self.path)
            if route is None:
                self._send(404, {"error": f"no route {self.path}"})
                return
            try:
                body = read_json_body(self.headers, self.rfile, self.connection, body_timeout)
                reply = route(body)
            except BodyError as exc:
                self.close_connection = True  # the rest of the body would read as a request
                self._send(exc.status, {"error": str(exc)})
                return
            except ValueError as exc:  # RequestError, and the endpoints' own refusals
                self._send(getattr(exc, "status", 400), {"error": str(exc)})
                return
            except Exception as exc:  # a bug: answered (500), not a connection dropped unanswered
                traceback.print_exc(file=sys.stderr)
                self._send(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})
                return
            self._send(200, reply)

    return Handler


class Server(ThreadingHTTPServer):
    # the stdlib's listen backlog is 5; a client with --sglang-server-concurrency 64 opens that
    # many connections at once, and connections past the backlog can be reset (seen here)
    request_queue_size = 1024


def serve(
    hf_checkpoint: str,
    host: str,
    port: int,
    num_threads: int,
    dtype: str = "auto",
    enable_lora: bool = False,
    fp32_lm_head: bool = True,
) -> int:
    configure_determinism(0, num_threads)
    precision, why = resolve(DTYPES[dtype], torch.device("cpu"))
    engine = EngineServer(hf_checkpoint, precision, enable_lora, fp32_lm_head)
    try:
        httpd = Server((host, port), make_handler(engine))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    httpd.daemon_threads = True
    bound_host, bound_port = httpd.server_address[:2]
    print(
        f"mileage serve: listening on http://{bound_host}:{bound_port} "
        f"(--dtype {torch_dtype_name(precision)}, {why})",
        flush=True,
    )
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    return serve(
        args.hf_checkpoint,
        args.host,
        args.port,
        args.num_threads,
        args.dtype,
        args.enable_lora,
        args.fp32_lm_head,
    )


# more torch threads than 4 per CPU only wait on each other (and a typo could start thousands)
MAX_THREADS = 4 * (os.cpu_count() or 1)


def _int_in(low: int, high: int, what: str, hint: str):
    """An argparse type: an integer in [low, high], or one line (`mileage: error: ...`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {hint}")
        return value

    return parse


def register(sub) -> None:
    parser = sub.add_parser(
        "serve", help="serve a model over SGLang's native HTTP API (/generate, weight reloads)"
    )
    parser.add_argument("--hf-checkpoint", required=True, help="HF model directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=_int_in(0, 65535, "a port number", "give 1..65535, or 0 for a free one"),
        default=30000,
        help="port (default 30000; 0 picks a free one)",
    )
    parser.add_argument(
        "--num-threads",
        type=_int_in(1, MAX_THREADS, "a thread count", f"give 1..{MAX_THREADS} (4 per CPU here)"),
        default=1,
        help="torch CPU threads (fixed for reproducibility)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="auto",
        help="compute precision over fp32 weights, as vLLM/SGLang spell it; auto: bfloat16 where "
        "the CPU computes bf16 natively (AMX or AVX512-BF16), else float32 (default auto)",
    )
    parser.add_argument(
        "--no-fp32-lm-head",
        dest="fp32_lm_head",
        action="store_false",
        help="in bfloat16, sample from logits rounded to bf16 instead of computing the LM head in "
        "fp32 (SGLang's --enable-fp32-lm-head is the opposite switch; mileage's default is on)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="take LoRA adapters at run time (SGLang's flag and endpoints: /load_lora_adapter, "
        "lora_path in /generate); a LoRA run then syncs the adapter alone",
    )
    parser.set_defaults(func=_cmd_serve)
