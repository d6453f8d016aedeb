"""What the crash-anywhere harness kills and what it records: the named kill points, the run it
kills (`crash_run_args`), `Kill` (a fault point or a delay), and per launch a `Launch` and per
kill an `Outcome`. Running the launches is `crash.py`'s part.
"""

from __future__ import annotations

import random
import re
import signal
from dataclasses import dataclass, field

# in the order one rollout reaches them (optimizer_step once per optimizer step)
LOOP_POINTS = ("rollout_start", "after_generate", "optimizer_step", "after_train", "after_metrics")


# inside the checkpoint write; with --async-save they run in the background writer thread
# (store.py's docstring names each gap of the commit order)
SAVE_POINTS = (
    "save_after_model",
    "save_after_optimizer",
    "save_after_state",
    "save_before_manifest",
    "commit_before_rename",
    "commit_after_rename",
    "commit_before_tracker",
    "tracker_before_replace",
    "commit_after_tracker",
    "save_after_prune",
)


# reached after the tracker has moved: the checkpoint being saved is committed
COMMITTED_SAVE_POINTS = ("commit_after_tracker", "save_after_prune")
# between a checkpoint's rename and its tracker's move: the checkpoint is complete, untracked
RENAMED_SAVE_POINTS = ("commit_after_rename", "commit_before_tracker", "tracker_before_replace")


# `mileage train-async` only: in the generation thread while the trainer trains (slot N+1
# during rollout N), right before the engine gets new weights, and halfway through copying them
ASYNC_POINTS = ("async_generating", "before_weight_sync", "mid_weight_sync")


KILL_POINTS = LOOP_POINTS + SAVE_POINTS + ASYNC_POINTS


# `mileage train` with dynamic sampling only: after each sampling round of a rollout (the kept
# groups beyond the batch are in the rollout buffer, not yet saved)
DYNAMIC_POINTS = ("after_sampling_round",)


# multi-turn runs with a tool only: in the trainer, right after a tool call was handed to its
# worker process (the tool is running)
TOOL_POINTS = ("tool_running",)


# --agent-function-path runs only: in the endpoint, when an agent's request has been read (its
# answers not yet generated: between turns), and when its answers are generated and journaled
# but not yet sent (mid-request)
AGENT_POINTS = ("agent_request", "agent_answered")


# PPO only: the critic is written into the same staging directory, after the actor's optimizer
CRITIC_SAVE_POINTS = ("save_after_critic_model", "save_after_critic")


PPO_SAVE_POINTS = SAVE_POINTS[:2] + CRITIC_SAVE_POINTS + SAVE_POINTS[2:]


# The run both the pytest harness and scripts/soak.py kill: two optimizer steps per rollout
# (32 samples, global batch 16), warmup then cosine decay, shuffled prompts and an evaluation
# every third rollout: state a resume has to get exactly right.
STEPS_PER_ROLLOUT = 2


def crash_run_args(num_rollout: int = 6, async_save: bool = False) -> list[str]:
    """`mileage train` flags of the run under test (the harness adds --save/--load/--save-interval)."""
    args = [
        "--num-rollout", str(num_rollout),
        "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4",
        "--global-batch-size", str(8 * 4 // STEPS_PER_ROLLOUT),
        "--lr-warmup-iters", "2",
        "--lr-decay-style", "cosine",
        "--rollout-shuffle",
        "--eval-interval", "3",
        "--num-threads", "1",
    ]  # fmt: skip
    return [*args, "--async-save"] if async_save else args


# PPO with GAE, normalised advantages, its own critic LR and one critic-only rollout first
# (state the critic's resume has to get exactly right)
PPO_CRITIC_ARGS = [
    "--advantage-estimator", "ppo",
    "--normalize-advantages",
    "--lambd", "0.95",
    "--critic-lr", "3e-4",
    "--num-critic-only-steps", "1",
]  # fmt: skip


def ppo_crash_run_args(num_rollout: int = 4) -> list[str]:
    """The crash run with a critic (`PPO_CRITIC_ARGS`)."""
    return [*crash_run_args(num_rollout), *PPO_CRITIC_ARGS]


_PLAN_RE = re.compile(
    r"^plan: (?:(?:fresh start|resume) at rollout (\d+)|nothing to do) of (\d+)", re.MULTILINE
)


_SIGKILLED = -signal.SIGKILL


@dataclass(frozen=True)
class Kill:
    """Where one launch is killed: a named fault point (+ hit) or a delay after launch.

    A delay counts from the launch, or, with `after_line`, from the first stdout line that
    starts with it: on a loaded machine start-up time varies by seconds, so a delay aimed at
    training counts from the plan line rather than from the process start.
    """

    point: str | None = None
    hit: int = 1
    delay: float | None = None
    rank: int = 0  # under torchrun: the rank that dies at the point
    after_line: str | None = None

    def __post_init__(self) -> None:
        if (self.point is None) == (self.delay is None):
            raise ValueError("a Kill needs exactly one of a point and a delay")
        known = KILL_POINTS + CRITIC_SAVE_POINTS + DYNAMIC_POINTS + TOOL_POINTS + AGENT_POINTS
        if self.point is not None and self.point not in known:
            raise ValueError(f"unknown kill point {self.point!r}; known: {', '.join(known)}")
        if self.hit < 1:
            raise ValueError(f"hit must be >= 1, got {self.hit}")
        if self.delay is not None and self.delay < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay}")
        if self.after_line is not None and self.delay is None:
            raise ValueError("after_line anchors a delay; a point kill has none")

    @classmethod
    def at(cls, point: str, hit: int = 1, rank: int = 0) -> Kill:
        return cls(point=point, hit=hit, rank=rank)

    @classmethod
    def after(cls, seconds: float, line: str | None = None) -> Kill:
        return cls(delay=seconds, after_line=line)

    @property
    def label(self) -> str:
        if self.point:
            return f"{self.point}:{self.hit}"
        anchor = f"'{self.after_line.strip()}'" if self.after_line else "t"
        return f"{anchor}+{self.delay:.2f}s"

    def env(self) -> dict[str, str]:
        if not self.point:
            return {}
        return {"MILEAGE_KILL_AT": f"{self.point}:{self.hit}", "MILEAGE_KILL_RANK": str(self.rank)}


def random_time_kills(count: int, seed: int, low: float, high: float) -> list[Kill]:
    """`count` kills at delays drawn uniformly from [low, high] seconds by Random(seed)."""
    rng = random.Random(seed)
    return [Kill.after(round(rng.uniform(low, high), 2)) for _ in range(count)]


def landed_mid_run(outcome: Outcome) -> bool:
    """The kill killed a launch that had started training (printed its plan) and not finished."""
    return outcome.died and outcome.launch is not None and outcome.launch.plan is not None


@dataclass
class Launch:
    """One process of a run."""

    kill: Kill | None
    returncode: int
    seconds: float
    stdout: str
    stderr: str
    timed_out: bool = False
    # (seconds after launch, line) for every stdout line, to place random-time kills
    stdout_times: list[tuple[float, str]] = field(default_factory=list)

    def first_line_time(self, prefix: str) -> float | None:
        return next((t for t, line in self.stdout_times if line.startswith(prefix)), None)

    def last_line_time(self, prefix: str) -> float | None:
        times = [t for t, line in self.stdout_times if line.startswith(prefix)]
        return times[-1] if times else None

    @property
    def died_by_kill(self) -> bool:
        # torchrun exits 1 when a worker died; its failure report names the signal
        killed = self.returncode == _SIGKILLED or (
            self.returncode == 1 and "Signal 9 (SIGKILL)" in self.stderr
        )
        return killed and not self.timed_out

    @property
    def plan(self) -> tuple[int, int] | None:
        """(first rollout this process planned to run, num_rollout) from its last plan line.

        A run with nothing left to do reports num_rollout as its first rollout. None when the
        process died before printing a plan.
        """
        matches = list(_PLAN_RE.finditer(self.stdout))
        if not matches:
            return None
        start, total = matches[-1].groups()
        return (int(start) if start is not None else int(total)), int(total)

    def tail(self, lines: int = 5) -> str:
        return " / ".join((self.stderr or self.stdout).strip().splitlines()[-lines:])


@dataclass
class Outcome:
    """What one kill did, and whether the run recovered from it.

    `tracker` and `logged` are read from disk right after the kill: the last committed rollout
    and the last rollout in metrics.jsonl. `rollout` is the rollout the kill hit: for a save
    point the rollout being saved, otherwise the first rollout not yet logged.
    """

    kill: Kill
    launch: Launch | None  # None: the run had already finished when this kill's turn came
    tracker: int | None = None
    logged: int | None = None
    rollout: int | None = None
    intact: bool = True  # the tracker names a checkpoint whose files match its manifest
    expected_start: int | None = (
        None  # where the next process must start: tracker (or newest complete) + 1
    )
    resumed_at: int | None = None  # where the next process that printed a plan started
    resumed: bool = False  # it started at expected_start, and the run then finished
    problems: list[str] = field(default_factory=list)

    @property
    def died(self) -> bool:
        return self.launch is not None and self.launch.died_by_kill

    @property
    def status(self) -> str:
        if self.launch is None:
            return "not reached (run had finished)"
        if self.launch.timed_out:
            return "timed out"
        if self.died:
            return "killed"
        if self.launch.returncode == 0:
            return "finished first"
        return f"failed (rc {self.launch.returncode})"
