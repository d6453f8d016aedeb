"""remote_rm against a reward server on 127.0.0.1 that this test starts and stops."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import fast_train_args

from mileage.checkpoint.inspect import list_checkpoints
from mileage.errors import UserError
from mileage.rollout.rewards import RewardConfig, build_reward_fn, score_all


class RewardServer:
    """Scores `response == label`; `behaviour(n)` may override request number n (from 1)."""

    def __init__(self, behaviour=lambda n: None):
        self.behaviour = behaviour
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.release = threading.Event()  # ends hanging handlers when the test is done

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    number = len(server.requests)
                action = server.behaviour(number)
                if action == "hang":
                    server.release.wait(10)
                    return
                if action in ("404", "503"):
                    self.send_error(int(action))
                    return
                if action == "cut":  # dies mid-answer: a body promised, none sent
                    self.send_response(200)
                    self.send_header("Content-Length", "186")
                    self.end_headers()
                    self.close_connection = True
                    return
                if action == "garbage":
                    answer = b"<html>oops</html>"
                elif action is not None:
                    answer = json.dumps(action).encode()
                else:
                    answer = json.dumps(float(body["response"] == body["label"])).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        return Handler


@contextmanager
def serve(behaviour=lambda n: None) -> Iterator[tuple[str, RewardServer]]:
    state = RewardServer(behaviour)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), state.handler())
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/score", state
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def remote(url: str, **overrides):
    cfg = {"rm_type": "remote_rm", "rm_url": url, "rm_timeout": 0.5, "rm_retries": 2}
    return build_reward_fn(RewardConfig(**{**cfg, **overrides}))


def test_sends_prompt_response_label_and_reads_the_number():
    with serve() as (url, server):
        fn = remote(url)
        assert score_all(fn, [("p1", "25", "25"), ("p2", "24", "25")]) == [1.0, 0.0]
    assert sorted(server.requests, key=lambda r: r["prompt"]) == [
        {"prompt": "p1", "response": "25", "label": "25"},
        {"prompt": "p2", "response": "24", "label": "25"},
    ]


def test_an_object_with_a_reward_is_accepted():
    with serve(lambda n: {"reward": 0.25, "other": 1}) as (url, _):
        assert score_all(remote(url), [("p", "r", "l")]) == [0.25]


def test_boxed_remote_sends_only_the_boxed_answer():
    with serve() as (url, server):
        fn = remote(url, rm_type="boxed_remote_rm")
        assert score_all(fn, [("p", "so \\boxed{7}", "7")]) == [1.0]
    assert server.requests[0]["response"] == "7"


def test_a_server_that_fails_twice_then_answers_succeeds():
    with serve(lambda n: "503" if n <= 2 else None) as (url, server):
        assert score_all(remote(url), [("p", "x", "x")]) == [1.0]
    assert len(server.requests) == 3


def test_a_rollout_is_scored_concurrently():
    barrier = threading.Barrier(4, timeout=5)

    def wait_for_all(n):
        barrier.wait()  # breaks (-> an exception, no answer) unless 4 requests are in flight
        return 1.0

    with serve(wait_for_all) as (url, _):
        assert score_all(remote(url, rm_timeout=8.0), [("p", "r", "l")] * 4) == [1.0] * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ("down", "unreachable"),
        ("hang", "did not answer within 0.5s"),
        ("garbage", "not JSON"),
        ([1, 2], "not a finite number"),
        ("503", "HTTP 503"),
        ("cut", r"broke off its answer \(IncompleteRead\)"),
    ],
)
def test_bad_servers_end_in_one_user_error_after_bounded_retries(behaviour, message):
    if behaviour == "down":
        url, server = f"http://127.0.0.1:{free_port()}/score", None
        with pytest.raises(UserError, match=f"{message}.*attempt 3 of 3"):
            score_all(remote(url), [("p", "r", "l")])
        return
    with (
        serve(lambda n: behaviour) as (url, server),
        pytest.raises(UserError, match=f"{message}.*attempt 3 of 3") as caught,
    ):
        score_all(remote(url), [("p", "r", "l")])
    assert len(server.requests) == 3  # 1 try + 2 retries, no more
    assert "\n" not in str(caught.value)


def test_a_client_error_is_not_retried():
    with (
        serve(lambda n: "404") as (url, server),
        pytest.raises(UserError, match="HTTP 404.*attempt 1 of 3"),
    ):
        score_all(remote(url), [("p", "r", "l")])
    assert len(server.requests) == 1


def test_training_stops_with_one_line_and_the_last_checkpoint_untouched(tmp_path, tiny_hf, cli):
    """Rollout 0 is scored and saved; the server then turns to garbage during rollout 1."""
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8))
    )
    per_rollout = 4 * 4
    with serve(lambda n: None if n <= per_rollout else "garbage") as (url, server):
        args = fast_train_args(tiny_hf, "--prompt-data", data, "--rm-type", "remote_rm")
        result = cli(
            "train",
            *args,
            "--rm-url",
            url,
            "--rm-timeout",
            "2",
            "--rm-retries",
            "1",
            "--num-rollout",
            "3",
            "--save",
            tmp_path / "run",
            "--load",
            tmp_path / "run",
            "--save-interval",
            "1",
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("mileage: error: reward server") and "not JSON" in result.stderr
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    [only] = list_checkpoints(str(tmp_path / "run"))
    assert only["complete"] and only["tracked"], only
    # the retries are bounded: each sample of rollout 1 is tried at most twice
    assert per_rollout + 2 <= len(server.requests) <= per_rollout + 2 * per_rollout
