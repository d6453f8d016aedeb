"""`mileage serve`'s request boundary: every field a client sends is checked here, once, before
the server acts on it.

A request the server cannot take is answered with HTTP 400 (413, 408 or 411 for a body it will
not or could not read) and `{"error": "<field>: expected ..., got ..."}`; the connection stays
usable unless the body was not read whole. Nothing a client sends reaches the engine unchecked:
a wrongly typed value would otherwise raise in a handler thread, which drops the connection
without a reply, and a value of the right type but out of range (an infinite temperature, a
boolean as a token id) would be sampled with.
"""

from __future__ import annotations

import json
import math
import re
import socket
import time
from dataclasses import dataclass
from email.message import Message
from typing import Any, BinaryIO

from mileage.rollout.engine import SamplingParams
from mileage.serve.lora import lora_name_of

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "sampling_seed", "top_k", "n"}
# a larger body is refused before any of it is read. The largest a client sends is an adapter
# inside the request (base64 safetensors): one of several hundred MB fits.
MAX_BODY_BYTES = 1 << 30
# the whole body must arrive within this: a client that stalls mid-body (or announces more than
# it sends) gets 408 instead of holding a handler thread forever
BODY_TIMEOUT_S = 300.0
# what torch.Generator.manual_seed takes
SEED_MIN, SEED_END = -(1 << 63), 1 << 64


class RequestError(ValueError):
    """The request asks for something malformed or unsupported (HTTP `status`, 400 by default)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class BodyError(RequestError):
    """The body was not read whole: the connection's stream is at an unknown place, so the
    server answers and closes it."""


@dataclass(frozen=True)
class GenerateRequest:
    rows: list[list[int]]
    single: bool  # one prompt as a flat list: one reply object, not a list (SGLang's shape)
    params: SamplingParams
    seeds: list[int] | None  # one per row, or None: the server draws a seed
    adapter: str | None  # the LoRA adapter to generate with (lora_path), or the base alone


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


# --- the body ----------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise RequestError(f"the request body is not standard JSON: {name} is not a number")


def read_json_body(
    headers: Message,
    rfile: BinaryIO,
    connection: socket.socket,
    timeout: float = BODY_TIMEOUT_S,
    limit: int = MAX_BODY_BYTES,
) -> dict:
    """The request's JSON object: its Content-Length checked before anything is read, and the
    read bounded by `timeout` seconds for the whole body (raises BodyError otherwise)."""
    if headers.get("Transfer-Encoding"):
        raise BodyError("send the body with a Content-Length, not chunked", 411)
    raw = headers.get("Content-Length", "0").strip()
    if not re.fullmatch(r"[0-9]+", raw):
        raise BodyError(f"Content-Length: expected a byte count (0 or more), got {raw!r}")
    if len(raw) > 18 or int(raw) > limit:
        raise BodyError(
            f"Content-Length: {raw} bytes is more than the {limit} this server takes", 413
        )
    data = _read_exactly(rfile, connection, int(raw), timeout)
    try:
        body = json.loads(data or b"{}", parse_constant=_no_constant)
    except RecursionError:
        raise RequestError("the request body nests too deeply") from None
    except RequestError:
        raise
    except ValueError as exc:  # UnicodeDecodeError included
        raise RequestError(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_show(body)}")
    return body


def _read_exactly(rfile: BinaryIO, connection: socket.socket, length: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    got = 0
    previous = connection.gettimeout()
    try:
        while got < length:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            connection.settimeout(remaining)
            # a chunk at a time: memory grows with what arrives, not with what was announced
            chunk = rfile.read1(min(length - got, 1 << 20))  # type: ignore[attr-defined]
            if not chunk:
                raise BodyError(f"the body ended after {got} of its {length} bytes")
            chunks.append(chunk)
            got += len(chunk)
    except TimeoutError:
        raise BodyError(
            f"the body did not arrive within {timeout:g} s ({got} of its {length} bytes)", 408
        ) from None
    finally:
        connection.settimeout(previous)
    return b"".join(chunks)


# --- the fields --------------------------------------------------------------------------------


def version_label(value: Any, field: str) -> str:
    """A weight version as clients send it (a string or an integer), as the server keeps it."""
    if isinstance(value, str) or _is_int(value):
        return str(value)
    raise RequestError(f"{field}: expected a string or an integer, got {_show(value)}")


def parse_weight_update(body: dict) -> tuple[str, str | None]:
    """`/update_weights_from_disk`: the model directory and the optional new weight version."""
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise RequestError(f"model_path: expected an HF model directory, got {_show(path)}")
    version = body.get("weight_version")
    return path, None if version is None else version_label(version, "weight_version")


def parse_generate(body: dict, vocab_size: int) -> GenerateRequest:
    """`/generate`: token-id rows in the vocabulary and one set of sampling parameters for all
    of them (lengths against the context are the server's check: it knows the model)."""
    if body.get("input_ids") is None:
        raise RequestError("input_ids: mileage serve takes token ids, not text")
    rows, single = _token_rows(body["input_ids"], vocab_size)
    sampling = body.get("sampling_params")
    per_row = sampling if isinstance(sampling, list) else [sampling or {}] * len(rows)
    if len(per_row) != len(rows):
        raise RequestError(
            f"sampling_params: expected one dict, or one per input ({len(rows)}), "
            f"got {len(per_row)}"
        )
    names = [
        f"sampling_params[{i}]" if isinstance(sampling, list) else "sampling_params"
        for i in range(len(rows))
    ]
    shapes = {_row_params(s, where) for s, where in zip(per_row, names, strict=True)}
    if len(shapes) != 1:
        raise RequestError(
            "sampling_params: all rows of one request need the same "
            "max_new_tokens/temperature/top_p"
        )
    max_new, temperature, top_p = shapes.pop()
    logprob = body.get("return_logprob")
    if logprob is not None and not isinstance(logprob, bool):
        raise RequestError(f"return_logprob: expected true or false, got {_show(logprob)}")
    return GenerateRequest(
        rows=rows,
        single=single,
        params=SamplingParams(max_new, float(temperature), float(top_p)),
        seeds=_seeds(per_row, names),
        adapter=lora_name_of(body, len(rows)),
    )


def _token_rows(value: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    if not isinstance(value, list) or not value:
        raise RequestError(
            f"input_ids: expected a non-empty list of token ids, or a list of such lists, "
            f"got {_show(value)}"
        )
    single = not isinstance(value[0], list)
    rows = [value] if single else value
    for i, row in enumerate(rows):
        where = "input_ids" if single else f"input_ids[{i}]"
        if not isinstance(row, list) or not row:
            raise RequestError(f"{where}: expected a non-empty list of token ids, got {_show(row)}")
        for j, token in enumerate(row):
            if not (_is_int(token) and 0 <= token < vocab_size):
                raise RequestError(
                    f"{where}[{j}]: expected a token id, an integer in [0, {vocab_size}), "
                    f"got {_show(token)}"
                )
    return rows, single


def _row_params(s: Any, where: str) -> tuple[int, float, float]:
    if not isinstance(s, dict):
        raise RequestError(f"{where}: expected a dict of sampling parameters, got {_show(s)}")
    unknown = set(s) - SAMPLING_KEYS
    if unknown:
        raise RequestError(f"{where}: mileage serve does not support {sorted(unknown)}")
    max_new = s.get("max_new_tokens", 128)
    if not (_is_int(max_new) and max_new > 0):
        raise RequestError(
            f"{where}.max_new_tokens: expected a positive integer, got {_show(max_new)}"
        )
    temperature = _number(s, "temperature", where)
    if temperature < 0:
        raise RequestError(f"{where}.temperature: expected 0 or more, got {_show(temperature)}")
    top_p = _number(s, "top_p", where)
    if not 0 < top_p <= 1:
        raise RequestError(f"{where}.top_p: expected a number in (0, 1], got {_show(top_p)}")
    top_k, n = s.get("top_k"), s.get("n")
    if top_k is not None and not (_is_int(top_k) and top_k == -1):
        raise RequestError(f"{where}.top_k: mileage serve supports -1 (no top-k) only, got "
                           f"{_show(top_k)}")  # fmt: skip
    if n is not None and not (_is_int(n) and n == 1):
        raise RequestError(f"{where}.n: mileage serve supports n=1 only, got {_show(n)}")
    return max_new, temperature, top_p


def _number(s: dict, key: str, where: str) -> float:
    value = s.get(key)
    if value is None:
        return 1.0  # SGLang's default for both temperature and top_p
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{where}.{key}: expected a finite number, got {_show(value)}")
    return value


def _seeds(per_row: list[dict], names: list[str]) -> list[int] | None:
    seeds = [s.get("sampling_seed") for s in per_row]
    for seed, where in zip(seeds, names, strict=True):
        if seed is not None and not (_is_int(seed) and SEED_MIN <= seed < SEED_END):
            raise RequestError(
                f"{where}.sampling_seed: expected an integer in [-2**63, 2**64), got {_show(seed)}"
            )
    if all(seed is None for seed in seeds):
        return None
    if any(seed is None for seed in seeds):
        raise RequestError("sampling_seed: give it for every row of a request or for none")
    return seeds
