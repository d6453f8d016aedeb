"""JSON over HTTP to a pool of servers, with bounded timeouts and retries on another server.

A request that fails (connection refused, timeout, HTTP error, a reply that does not parse or
that `validate` rejects) is retried on the next server in the pool, up to `attempts` tries in
all; a server that failed is tried last from then on. When every try failed the run stops with
one `UserError` line naming each failure. Only the standard library is used.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mileage.errors import UserError


class BadReply(Exception):
    """A server answered, but not with what was asked for (garbage, stale weights)."""


def _json_reply(
    request: urllib.request.Request | str, timeout: float, text_ok: bool = False
) -> Any:
    """Send `request`, return the parsed reply; raises OSError/BadReply on failure. With
    `text_ok`, a 2xx body that is not JSON is returned as text (vLLM answers its LoRA endpoints
    with a sentence)."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode(errors="replace")
        raise BadReply(f"HTTP {exc.code}: {detail}") from None
    except http.client.HTTPException as exc:
        # a server that dies mid-reply: a cut-off body (IncompleteRead) or status line
        raise BadReply(f"broken reply ({type(exc).__name__})") from None
    if not body.strip():
        # an empty 2xx body is "done, nothing to say" (vLLM before 0.32 answers
        # /reset_prefix_cache so); a caller that needs content rejects the None
        return None
    try:
        return json.loads(body)
    except ValueError:
        if text_ok:
            return body.decode(errors="replace")
        raise BadReply(f"reply is not JSON: {body[:80]!r}") from None


def post_json(url: str, payload: Any, timeout: float, text_ok: bool = False) -> Any:
    """POST `payload` as JSON, return the parsed reply; raises OSError/BadReply on failure."""
    data = json.dumps(payload).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    return _json_reply(request, timeout, text_ok)


def get_json(url: str, timeout: float) -> Any:
    """GET `url`, return the parsed reply; raises OSError/BadReply on failure."""
    return _json_reply(url, timeout)


def get_ok(url: str, timeout: float) -> bool:
    """Whether GET `url` answers 200 within `timeout`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except (OSError, ValueError):
        return False


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) or "timed out" in str(exc):
        return "timed out"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


class ServerPool:
    """The servers of one engine; `map` spreads requests over them, `broadcast` hits each."""

    def __init__(
        self,
        urls: Sequence[str],
        timeout: float,
        attempts: int,
        what: str,
        log: Callable[[str], None] = print,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self.log = log  # says when a server is left out of generation, and when it is back
        self.timeout = timeout
        self.attempts = attempts
        self.what = what  # names the engine in error messages
        self.failed: set[str] = set()  # tried last until they succeed again
        self.excluded: set[str] = set()  # never tried (e.g. missed the last weight sync)
        self.in_flight = 1  # requests at once per server (a server that batches: more)
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[int, threading.Semaphore]] = {}

    def _slot(self, url: str) -> threading.Semaphore:
        with self._lock:
            slots = self._slots.get(url)
            if slots is None or slots[0] != self.in_flight:  # in_flight may be set after init
                slots = self._slots[url] = (self.in_flight, threading.Semaphore(self.in_flight))
            return slots[1]

    def _order(self, first: int) -> list[str]:
        usable = [u for u in self.urls if u not in self.excluded]
        rotated = usable[first % len(usable) :] + usable[: first % len(usable)] if usable else []
        return [u for u in rotated if u not in self.failed] + [
            u for u in rotated if u in self.failed
        ]

    def request(
        self,
        path: str,
        payload: Any,
        first: int = 0,
        validate: Callable[[Any], Any] | None = None,
    ) -> Any:
        """POST to the servers in turn, starting at server `first`; the first valid reply."""
        errors: list[str] = []
        tried: set[str] = set()
        for _ in range(self.attempts):
            with self._lock:
                order = self._order(first)
            if not order:
                break
            fresh = [u for u in order if u not in tried] or order
            if fresh is order:
                tried.clear()  # every server had its turn: go round again
            url = fresh[0]
            tried.add(url)
            try:
                with self._slot(url):  # at most `in_flight` requests at once per server
                    reply = post_json(url + path, payload, self.timeout)
                result = validate(reply) if validate else reply
            except (OSError, BadReply, ValueError) as exc:
                errors.append(f"{url}: {describe(exc)}")
                with self._lock:
                    self.failed.add(url)
                continue
            with self._lock:
                self.failed.discard(url)
            return result
        if not errors:
            errors.append("no server is usable (each missed the last weight sync)")
        raise UserError(
            f"{self.what}: {path} failed after {len(errors)} tries ({'; '.join(errors)}); "
            "the last checkpoint is untouched: rerun the same command once the servers are healthy"
        )

    def map(
        self, path: str, payloads: Sequence[Any], validators: Sequence[Callable[[Any], Any]]
    ) -> list:
        """All `payloads` (reply i checked and converted by `validators[i]`), request i starting
        at server i mod n, `in_flight` at once per server."""
        workers = max(1, len(self.urls) * self.in_flight)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout-http")
        try:
            futures = [
                pool.submit(self.request, path, p, i, v)
                for i, (p, v) in enumerate(zip(payloads, validators, strict=True))
            ]
            return [f.result() for f in futures]
        finally:
            # on an error, do not start what is still queued; requests in flight end by timeout
            pool.shutdown(wait=False, cancel_futures=True)

    def broadcast(
        self, path: str, payload: Any, timeout: float, text_ok: bool = False
    ) -> dict[str, str | None]:
        """POST to every server at once; per URL None (success) or the failure (`text_ok`: a
        2xx reply that is not JSON is a success)."""

        def one(url: str) -> str | None:
            try:
                reply = post_json(url + path, payload, timeout, text_ok)
            except (OSError, BadReply) as exc:
                return describe(exc)
            if isinstance(reply, dict) and reply.get("success") is False:
                # SGLang's weight updates say why in `message`, its LoRA updates in
                # `error_message`
                return str(reply.get("message") or reply.get("error_message") or "refused")
            return None

        with ThreadPoolExecutor(max_workers=max(1, len(self.urls))) as pool:
            return dict(zip(self.urls, pool.map(one, self.urls), strict=True))

    def sync(
        self,
        steps: Sequence[tuple[str, Any]],
        version: int,
        timeout: float,
        failed_before: dict[str, str] | None = None,
        on_failure: Callable[[str, str, str], None] | None = None,
        text_ok: bool = False,
    ) -> None:
        """Every server runs the weight-sync `steps` ((path, payload) POSTs, in order) for
        weight `version`. A server that failed any step, or is in `failed_before` (url -> why:
        it failed a check before the sync), is excluded from generation until a later sync
        reaches it (it would sample from old weights); when none succeeded the run stops, since
        no server holds the trainer's weights. `on_failure(url, path, why)` sees each failed
        step first (it may raise to stop the run, e.g. when the server lacks the endpoint)."""
        failed: dict[str, str] = dict(failed_before or {})
        for path, payload in steps:
            for url, why in self.broadcast(path, payload, timeout, text_ok).items():
                if why is not None:
                    if on_failure is not None:
                        on_failure(url, path, why)
                    failed.setdefault(url, f"{path}: {why}")
        if len(failed) == len(self.urls):
            details = "; ".join(f"{u}: {w}" for u, w in failed.items())
            raise UserError(
                f"{self.what}: no server loaded the weights of version {version} ({details}); "
                "the last checkpoint is untouched: rerun the same command once a server is healthy"
            )
        with self._lock:
            left_out, back = set(failed) - self.excluded, self.excluded - set(failed)
            self.excluded = set(failed)
            self.failed -= set(self.urls) - set(failed)  # a server that just synced is healthy
        # once per change, not per sync: a dead server would otherwise repeat every rollout
        for url in sorted(left_out):
            self.log(
                f"{self.what}: {url} is left out of generation until a weight sync reaches "
                f"it ({failed[url].removeprefix(f'{self.what}: ')})"
            )
        for url in sorted(back):
            self.log(f"{self.what}: {url} is back (it loaded weight version {version})")
