"""`--rm-type llm_judge`: a judge model behind an OpenAI-compatible server (vLLM, SGLang, any
`/v1/chat/completions`) scores each response.

The request is one user message: the template of `--judge-prompt-path` (or DEFAULT_TEMPLATE) with
`{prompt}`, `{response}`, `{label}` and `{max_score}` filled in one pass (any other brace, e.g. a
JSON example in the template, stays as written). It carries `--judge-temperature`, a
`--judge-max-tokens` cap and a seed derived from the request, so a server that honours seeds
answers a repeated request alike.

The reply's score is read by `parse_score` and divided by `--judge-max-score`: the reward is in
[0, 1]. A reply without a readable score in [0, max] is a named failure, never a silent 0: it is
retried like a failed request (`--rm-retries`; a sampling judge may answer better), then the run
stops in one line quoting the reply, before the rollout trains or saves anything.

Requests are bounded by `--rm-timeout` and `--rm-max-concurrency`, and the server is asked for
its models when the run is built, so an unreachable judge stops the run before anything loads.
The scores are journaled with the rollout (`mileage.rollout.rewards.journaled`): a rerun after a
kill trains on the killed run's scores, whatever the judge would say now.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from mileage.errors import UserError
from mileage.rollout.rewards.remote import RemoteReward, RewardServerError

DEFAULT_TEMPLATE = """You are grading an answer to a task.

Task:
{prompt}

Reference answer:
{label}

Answer to grade:
{response}

Rate how well the answer solves the task, from 0 (wrong) to {max_score} (fully correct and \
matching the reference). Reply with one line: Score: N
"""
FIELDS = ("prompt", "response", "label", "max_score")
PLACEHOLDER = re.compile(r"\{(" + "|".join(FIELDS) + r")\}")

NUMBER = r"[-+]?\d+(?:\.\d+)?"
OUT_OF = rf"(?:\s*(?:/|out\s+of)\s*({NUMBER}))?"
# "Score: 7", "**Rating**: 7/10", "score = 7 out of 10", "Final grade is 7": the last one counts
LABELLED = re.compile(
    rf"\b(?:score|rating|grade)\b[*_]*\s*(?:is|of|=|:)?\s*[*_]*\s*({NUMBER}){OUT_OF}", re.I
)
BRACKETED = re.compile(rf"\[\[\s*({NUMBER})\s*\]\]")  # MT-Bench's "[[7]]"
BARE = re.compile(rf"^\s*({NUMBER}){OUT_OF}\s*[.!]?\s*$")  # the whole reply is the number
THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.S)


class JudgeReplyError(RewardServerError):
    """A reply without a usable score (retried, then named)."""


def render(template: str, **fields: object) -> str:
    """`template` with each known placeholder replaced once (values are not re-scanned)."""
    return PLACEHOLDER.sub(lambda m: str(fields[m.group(1)]), template)


def parse_score(text: str, max_score: float) -> float:
    """The judge's score in `text` over `max_score` (in [0, 1]), or JudgeReplyError saying what
    is wrong. Read in order: a JSON object's "score", the last labelled score ("Score: 7",
    "rating: 7/10"), the last "[[7]]", a reply that is only a number. Reasoning in
    <think>...</think> is skipped; a score "out of" another scale than `max_score` is refused."""
    body = THINK.sub("", text)
    shown = _excerpt(text)
    if re.search(r"<think>", body, re.I):
        raise JudgeReplyError(
            f"replied {shown}, which ends inside <think> (see --judge-max-tokens)"
        )
    found = _json_score(body) or _last(LABELLED, body) or _last(BRACKETED, body)
    if found is None and (bare := BARE.match(body)):
        found = bare.group(1), bare.group(2)
    if found is None:
        raise JudgeReplyError(
            f"replied {shown}, which holds no score (expected e.g. 'Score: 7', "
            "'{\"score\": 7}' or '[[7]]')"
        )
    value, scale = float(found[0]), found[1]
    if scale is not None and float(scale) != max_score:
        raise JudgeReplyError(
            f"replied {shown}, a score out of {scale} where --judge-max-score is {max_score:g}"
        )
    if not (math.isfinite(value) and 0.0 <= value <= max_score):
        raise JudgeReplyError(f"replied {shown}, a score outside [0, {max_score:g}]")
    return value / max_score


def _last(pattern: re.Pattern, text: str) -> tuple[str, str | None] | None:
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1), (last.group(2) if last.re.groups > 1 else None)


def _json_score(text: str) -> tuple[str, None] | None:
    fenced = FENCE.search(text)
    candidate = fenced.group(1) if fenced else text.strip()
    if not candidate.startswith("{"):
        return None
    try:
        value = json.loads(candidate)
    except ValueError:
        return None
    score = value.get("score") if isinstance(value, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float):
        return None
    return repr(float(score)), None


def _excerpt(text: str, limit: int = 80) -> str:
    one_line = " ".join(text.split())
    return repr(one_line if len(one_line) <= limit else one_line[: limit - 3] + "...")


def load_template(path: str | None) -> str:
    """The judge's prompt template (the default without a path); one line and exit 2 if the
    file cannot be read or never shows the judge the response."""
    if path is None:
        return DEFAULT_TEMPLATE
    try:
        template = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--judge-prompt-path {path}: cannot read it ({exc})") from None
    if "{response}" not in template:
        raise UserError(
            f"--judge-prompt-path {path}: the template has no {{response}} placeholder, so the "
            "judge would never see the answer it grades (placeholders: "
            + ", ".join(f"{{{f}}}" for f in FIELDS)
            + ")"
        )
    return template


class JudgeReward(RemoteReward):
    """fn(prompt, response, label) -> score / max_score, asked of an OpenAI-compatible judge."""

    what = "the LLM judge"
    flags = "--rm-timeout, --rm-retries, --judge-max-tokens"

    def __init__(
        self,
        url: str,
        model: str | None,
        template: str,
        max_score: float,
        max_tokens: int,
        temperature: float,
        timeout_s: float,
        retries: int,
        concurrency: int,
    ):
        # an OpenAI base URL (".../v1") as clients take it; the endpoint itself is accepted too
        self.base = url.rstrip("/").removesuffix("/chat/completions")
        super().__init__(self.base + "/chat/completions", timeout_s, retries, concurrency)
        self.template, self.max_score = template, max_score
        self.max_tokens, self.temperature = max_tokens, temperature
        self.model = self._served_model(model)

    def _served_model(self, model: str | None) -> str:
        """`model`, or the first the server lists; asking also proves the judge is reachable
        before the run builds anything else."""
        try:
            listed = json.loads(self.request(self.base + "/models", None, self.timeout_s))
            ids = [m["id"] for m in listed["data"] if isinstance(m.get("id"), str)]
        except RewardServerError as exc:
            raise UserError(
                f"the LLM judge {self.base} {exc} when asked for /models; --rm-url takes the "
                "OpenAI base URL of a running judge server (e.g. http://127.0.0.1:8000/v1)"
            ) from None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(
                f"the LLM judge {self.base}/models did not answer an OpenAI model list; "
                "--rm-url takes the OpenAI base URL of a judge server (e.g. .../v1)"
            ) from None
        if model is not None:
            return model
        if not ids:
            raise UserError(f"the LLM judge {self.base} lists no model; name one: --judge-model")
        return ids[0]

    @property
    def plan_line(self) -> str:
        """What the plan says of this reward before the run trains."""
        return (
            f"reward: the LLM judge {self.base} (model {self.model}, score / "
            f"{self.max_score:g}, temperature {self.temperature:g}); its scores are journaled "
            "with each rollout, so a rerun after a kill trains on the same ones"
        )

    def body(self, prompt: str, response: str, label: str) -> dict:
        content = render(
            self.template, prompt=prompt, response=response, label=label,
            max_score=f"{self.max_score:g}",
        )  # fmt: skip
        seed = int(hashlib.sha256(content.encode()).hexdigest()[:8], 16)
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": seed,
        }

    def parse(self, body: bytes) -> float:
        try:
            content = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, UnicodeDecodeError, KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise RewardServerError(
                f"answered {_excerpt(body.decode('utf-8', 'replace'))}, not a chat completion "
                "with choices[0].message.content"
            )
        return parse_score(content, self.max_score)
