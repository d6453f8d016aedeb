"""A stand-in LLM judge for the tests: an OpenAI-compatible server (`GET /v1/models`, `POST
/v1/chat/completions`) whose replies are scripted, so the tests control what the judge says.

    python tests/judge_server.py MODE PORT_FILE [--port P] [--die-after N] [--log FILE]

MODE:
- graded: deterministic; "Score: 10" when the response contains the label, 5 when it starts
  with the label's first character, else 0 (the response is found between the default
  template's "Answer to grade:" and "Rate how well", or in a test template's "<<...>>");
- random: "Score: N" with N from os.urandom on every call (a judge that samples);
- garbage: "I cannot grade this." (no score);
- verdict: verifiers' reference judge: "yes" when the response equals the reference answer in
  its prompt (verifiers/v1/judges/reference.txt), else "no";
- think: a reasoning reply, "<think>Score: 1</think> ... Final score: 7/10".
--die-after N: the process exits (no reply) at its N+1-th chat request, as a killed server.
--log FILE: one line per chat request (the response graded), to count the calls.
The port is written to PORT_FILE once the server listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DEFAULT_TEMPLATE = re.compile(r"Answer to grade:\n(.*?)\n\nRate how well", re.S)
TEST_TEMPLATE = re.compile(r"<<(.*?)>>", re.S)
LABEL = re.compile(r"Reference answer:\n(.*?)\n\nAnswer to grade", re.S)
VF_ANSWER = re.compile(r"Reference answer:\n```\n(.*?)\n```", re.S)
VF_RESPONSE = re.compile(r"Response:\n```\n(.*?)\n```", re.S)


def response_of(content: str) -> tuple[str, str]:
    found = DEFAULT_TEMPLATE.search(content) or TEST_TEMPLATE.search(content)
    label = LABEL.search(content)
    return (found.group(1) if found else content), (label.group(1) if label else "")


def reply(mode: str, content: str) -> str:
    response, label = response_of(content)
    if mode == "graded":  # whole marks for the label, half for its first digit, else none
        if label and label in response:
            return "Score: 10"
        return "Score: 5" if label and response[:1] == label[:1] else "Score: 0"
    if mode == "random":
        return f"Score: {os.urandom(1)[0] % 11}"
    if mode == "verdict":
        answer, given = VF_ANSWER.search(content), VF_RESPONSE.search(content)
        return "yes" if answer and given and answer.group(1) == given.group(1) else "no"
    if mode == "garbage":
        return "I cannot grade this."
    if mode == "think":
        return "<think>At first glance Score: 1, but</think> it is mostly right. Final score: 7/10"
    raise ValueError(mode)


class StandIn:
    """tests/judge_server.py in its own process group, stopped by pid."""

    def __init__(self, tmp: Path, mode: str, *extra: str):
        port_file = tmp / f"judge-{mode}-{time.monotonic_ns()}.port"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, mode, str(port_file), *extra], start_new_session=True
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stand-in judge ({mode}) did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}/v1"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("graded", "random", "garbage", "think", "verdict"))
    parser.add_argument("port_file")
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--log", default=None)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    args = parser.parse_args()
    served = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *a) -> None:  # noqa: A002 - the stdlib's name
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "stand-in-judge"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": "not found"}})
                return
            served[0] += 1
            if args.die_after is not None and served[0] > args.die_after:
                os._exit(1)  # the server dies with the request unanswered
            content = body["messages"][-1]["content"]
            if args.log:
                with open(args.log, "a") as f:
                    f.write(json.dumps(response_of(content)[0]) + "\n")
            text = reply(args.mode, content)
            self._send(
                200,
                {
                    "id": f"chatcmpl-{served[0]}",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                },
            )

    # a rollout's requests arrive at once (--rm-max-concurrency 32): the stdlib's backlog of 5
    # would drop connections, which clients retry only after a second
    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
