"""`remote_rm`: POST each sample to an HTTP reward server, as miles does.

The request body is the JSON object `{"prompt": ..., "response": ..., "label": ...}`; the answer
must be a JSON number (miles uses the decoded body as the reward), or an object with a numeric
`"reward"`. A whole rollout is scored concurrently. A connection error, a timeout, a 5xx or 429
status or an answer that is not a finite number is retried with a short exponential backoff; when
the attempts are used up the run stops with one line naming the server and the last failure.
That happens while scoring, before the rollout trains or saves anything, so the last checkpoint
stays as it was.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from mileage.errors import UserError

BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 5.0


class RewardServerError(Exception):
    """One failed attempt; `retry` says whether another attempt could help."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


def parse_reward(body: bytes) -> float:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise RewardServerError(f"answered {body[:60]!r}, not JSON") from None
    if isinstance(value, dict) and "reward" in value:
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardServerError(f"answered {json.dumps(value)[:60]}, not a finite number")
    return float(value)


class RemoteReward:
    """Reward function that asks `url`; `score_batch` scores many samples at once. Subclasses
    (the LLM judge) change what is sent (`body`) and how the answer is read (`parse`)."""

    what = "reward server"  # how a failure names the server
    flags = "--rm-timeout, --rm-retries"

    def __init__(
        self,
        url: str,
        timeout_s: float,
        retries: int,
        concurrency: int,
        transform=lambda response: response,
    ):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--rm-url must be an http:// or https:// URL, got {url!r}")
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.concurrency = concurrency
        self.transform = transform  # the boxed_ prefix sends only the boxed answer

    def body(self, prompt: str, response: str, label: str) -> dict:
        """The JSON request for one sample."""
        return {"prompt": prompt, "response": self.transform(response), "label": label}

    def parse(self, body: bytes) -> float:
        """The reward in an answer's body, or RewardServerError (retried)."""
        return parse_reward(body)

    def request(self, url: str, payload: bytes | None, timeout_s: float) -> bytes:
        """The body of one answer (GET without a payload), or RewardServerError."""
        request = urllib.request.Request(
            url,
            data=payload,
            headers={"Content-Type": "application/json"},
            method="POST" if payload is not None else "GET",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return answer.read()
        except urllib.error.HTTPError as exc:
            retry = exc.code >= 500 or exc.code == 429
            raise RewardServerError(f"answered HTTP {exc.code} {exc.reason}", retry) from None
        except TimeoutError:
            raise RewardServerError(f"did not answer within {timeout_s:g}s") from None
        except http.client.HTTPException as exc:
            # a server that dies mid-answer: a cut-off body (IncompleteRead) or status line
            raise RewardServerError(f"broke off its answer ({type(exc).__name__})") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise RewardServerError(f"did not answer within {timeout_s:g}s") from None
            raise RewardServerError(f"unreachable ({reason})") from None

    def __call__(self, prompt: str, response: str, label: str) -> float:
        payload = json.dumps(self.body(prompt, response, label)).encode()
        for attempt in range(self.retries + 1):
            try:
                return self.parse(self.request(self.url, payload, self.timeout_s))
            except RewardServerError as exc:
                if not exc.retry or attempt == self.retries:
                    raise UserError(
                        f"{self.what} {self.url} {exc} (attempt {attempt + 1} of "
                        f"{self.retries + 1}; see {self.flags}); the last checkpoint is "
                        "unchanged"
                    ) from None
                time.sleep(min(BACKOFF_BASE_S * 2**attempt, BACKOFF_MAX_S))
        raise AssertionError("unreachable")

    def score_batch(self, items: list[tuple[str, str, str]]) -> list[float]:
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(items))))
        try:
            return list(pool.map(lambda item: self(*item), items))
        finally:
            # after a failure, samples not yet sent are dropped rather than retried one by one
            pool.shutdown(wait=True, cancel_futures=True)
