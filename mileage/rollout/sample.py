"""A sample: the prompt's token ids, then every token after them, with a per-token loss mask.

`response_ids` holds everything after the prompt in the order the model saw it: the model's own
turns and the tokens a tool or environment appended between them. `loss_mask[i]` says whether
response token i was sampled by the policy (1: trained, its log-prob is the engine's) or came
from outside (0: a tool's output, a chat template's role markers; never trained, its log-prob is a
0.0 placeholder). The ids are the engine's ids exactly: nothing between turns is re-tokenized, the
next turn's input is the previous ids plus the tool's ids.

Files written before the mask existed load with `loss_mask = None`, which means all ones (every
response token was the model's); `mask()` is what every reader uses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mileage.rollout.prompts import Prompt

# why a trajectory ended (`Sample.stop_reason`)
STOP = "stop"  # the model ended its turn (EOS) without calling a tool
LENGTH = "length"  # a turn hit its max new tokens, or the response budget ran out
MAX_TURNS = "max_turns"  # --generate-max-turns model turns, the last one still calling a tool
TOOL_ERROR = "tool_error"  # the tool raised, returned a non-string, or a call did not parse
TOOL_TIMEOUT = "tool_timeout"  # a tool call ran past --tool-timeout (its worker was killed)
# an agent's sample (--agent-function-path) that failed: nothing of it is trained
AGENT_ERROR = "agent_error"  # the agent raised
AGENT_TIMEOUT = "agent_timeout"  # it ran past --agent-timeout seconds of its own
AGENT_BAD_RETURN = "agent_bad_return"  # it returned neither a finite number nor None
AGENT_NO_CALLS = "agent_no_calls"  # it never called the endpoint
AGENT_FAILURES = (AGENT_ERROR, AGENT_TIMEOUT, AGENT_BAD_RETURN, AGENT_NO_CALLS)
STOP_REASONS = (STOP, LENGTH, MAX_TURNS, TOOL_ERROR, TOOL_TIMEOUT, *AGENT_FAILURES)


@dataclass
class ToolCall:
    """One tool call of a trajectory and what came back, as recorded for exact replay."""

    turn: int  # the model turn (0-based) whose text made the call
    name: str
    arguments: dict[str, Any]
    status: str  # "ok", TOOL_ERROR or TOOL_TIMEOUT
    output: str  # the tool's text ("ok") or the error's one-line description
    output_ids: list[int] = field(default_factory=list)  # what was appended to the response


@dataclass
class Sample:
    prompt: Prompt
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # of the generating policy per response token (0.0 where mask is 0)
    response: str
    reward: float
    finished: bool  # ended by the model (EOS, or a complete last turn), not by a length limit
    weight_version: int | None = None  # of the weights that generated it (None: older files)
    # per response token, the weight version that generated it (partial rollouts mix versions;
    # a tool token carries the version of the turn it answers); None in older files
    weight_versions: list[int] | None = None
    # per response token: 1 = sampled by the policy (trained), 0 = tool/environment (not
    # trained, no gradient); None = all ones (single-turn samples and files older than the mask)
    loss_mask: list[int] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: int = 1  # model turns taken
    stop_reason: str | None = None  # one of STOP_REASONS (None: a single-turn sample)
    metadata: dict[str, Any] = field(default_factory=dict)  # user data (--metadata-key, custom)
    # an agent's sample: its requests, segments, splits, ... (mileage.rollout.agents)
    agent_stats: dict[str, float] | None = None
    agent_failure: str | None = None  # the line naming why its agent failed
    # --partial-rollout with the built-in tool loop: how many ids at the end of `response_ids`
    # belong to a model turn that a sampling round's token budget cut (0: no turn is open);
    # the next round continues that turn before it reads the turn's tool calls
    open_turn: int = 0

    def mask(self) -> list[int]:
        """The loss mask per response token (all ones when none was recorded)."""
        if self.loss_mask is None:
            return [1] * len(self.response_ids)
        return self.loss_mask

    def used_tools(self) -> bool:
        """Whether the trajectory called a tool (an agent's: a call the endpoint handed out)."""
        return bool(self.tool_calls) or bool(self.agent_stats and self.agent_stats["tool_calls"])

    def oldest_version(self) -> int | None:
        """The oldest weight version among the sample's tokens (what its staleness counts)."""
        if self.weight_versions:
            return min(self.weight_versions)
        return self.weight_version

    def check(self) -> None:
        """Raise ValueError unless the per-token lists line up (user generate functions build
        samples; a mismatch would otherwise surface as a shape error deep in training)."""
        n = len(self.response_ids)
        lengths = {"logprobs": len(self.logprobs)}
        if self.loss_mask is not None:
            lengths["loss_mask"] = len(self.loss_mask)
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("loss_mask holds values other than 0 and 1")
        if self.weight_versions is not None:
            lengths["weight_versions"] = len(self.weight_versions)
        wrong = {k: v for k, v in lengths.items() if v != n}
        if wrong:
            raise ValueError(f"{n} response ids but {wrong}")
        if self.stop_reason is not None and self.stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason {self.stop_reason!r} is not one of {STOP_REASONS}")

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict (floats round-trip exactly through json)."""
        return asdict(self)

    @staticmethod
    def from_record(record: dict[str, Any]) -> Sample:
        """A sample from `to_record`'s dict, or from a file written before the multi-turn
        fields existed (they take their defaults: mask all ones, one turn, no tool calls)."""
        calls = [ToolCall(**c) for c in record.get("tool_calls", [])]
        return Sample(**{**record, "prompt": Prompt(**record["prompt"]), "tool_calls": calls})


def tool_metrics(samples: list[Sample]) -> dict[str, float]:
    """rollout/tool_calls, rollout/tool_errors, rollout/tool_timeouts, rollout/mean_turns and the
    share of each stop reason (only for multi-turn samples: single-turn ones record none)."""
    if not samples or all(s.stop_reason is None for s in samples):
        return {}
    calls = [c for s in samples for c in s.tool_calls]
    # an agent runs its tools itself: the endpoint counts the calls it handed out
    agent_calls = [s.agent_stats["tool_calls"] if s.agent_stats else 0.0 for s in samples]
    metrics = {
        "rollout/tool_calls": float(len(calls)) + sum(agent_calls),
        "rollout/tool_errors": float(sum(c.status == TOOL_ERROR for c in calls)),
        "rollout/tool_timeouts": float(sum(c.status == TOOL_TIMEOUT for c in calls)),
        "rollout/mean_turns": sum(s.turns for s in samples) / len(samples),
        "rollout/tool_use_rate": sum(s.used_tools() for s in samples) / len(samples),
    }
    stats = [s.agent_stats for s in samples if s.agent_stats]
    if stats:
        for name in ("splits", "untrained_tokens", "diverged"):
            metrics[f"rollout/agent_{name}"] = sum(st[name] for st in stats)
        metrics["rollout/agent_segments"] = sum(st["segments"] for st in stats) / len(stats)
        metrics["rollout/agent_failures"] = float(sum(bool(s.agent_failure) for s in samples))
    for reason in sorted({s.stop_reason for s in samples if s.stop_reason}):
        share = sum(s.stop_reason == reason for s in samples) / len(samples)
        metrics[f"rollout/stop_{reason}"] = share
    return metrics
