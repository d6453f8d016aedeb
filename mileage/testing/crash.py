"""Crash-anywhere harness: SIGKILL `mileage train`, rerun it, compare with an uninterrupted run.

The promise under test: kill a run at any instant, rerun the same command until it exits 0, and
the checkpoints hold the same tensors (bit for bit) and the metrics log the same per-rollout
records (wall-clock keys aside) as a run that was never interrupted.

A `Kill` is either a named fault point (`MILEAGE_KILL_AT`, see `mileage.faults`: the process
SIGKILLs itself the hit-th time it reaches the point) or a delay, after the launch or after a
stdout line, after which the harness SIGKILLs the process from outside. `run_with_kills` spends
one kill per launch, reruns the plain command until it exits 0, and returns one `Outcome` per
kill;
`mileage.testing.compare.compare_runs` lists every difference between two save directories.

Every launch is `python -m mileage train ARGS --save D --load D --save-interval 1`, or with
`nproc` > 1 the same under `torchrun --nproc-per-node nproc --standalone`; a kill point then
kills one rank (`Kill.rank`, default 0) and torchrun stops the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from mileage.checkpoint.layout import checkpoint_path, read_tracker, scan_dir
from mileage.checkpoint.store import verify_checkpoint
from mileage.metrics import METRICS_FILE
from mileage.preemption import STOPPED_EXIT
from mileage.testing.kills import (
    COMMITTED_SAVE_POINTS,
    PPO_SAVE_POINTS,
    RENAMED_SAVE_POINTS,
    Kill,
    Launch,
    Outcome,
)


class CrashHarnessError(RuntimeError):
    """A launch that had to succeed (the uninterrupted reference run) did not."""


def aimed_random_kills(
    reference: Launch, count: int, seed: int
) -> Callable[[list[Outcome]], Kill | None]:
    """Kills at random instants inside the training span of what is left of the run.

    The span is measured on the uninterrupted `reference` launch: from its plan line to its
    last rollout line, spread evenly over its rollouts. Each kill's delay is drawn, by
    Random(seed), uniformly over the first three quarters of the time that the rollouts the run
    has left after the previous kills took the reference. It counts from the killed launch's
    own plan line, so it lands while the run trains rather than before it starts (start-up on
    a loaded machine can take seconds longer than it did for the reference) or after it has
    finished. For `run_with_kills`.
    """
    planned = reference.first_line_time("plan:")
    last = reference.last_line_time("rollout ")
    plan = reference.plan
    if planned is None or last is None or plan is None:
        raise CrashHarnessError("the reference launch printed no plan or rollout lines to aim at")
    num_rollout = plan[1]
    per_rollout = (last - planned) / num_rollout
    rng = random.Random(seed)

    def next_kill(outcomes: list[Outcome]) -> Kill | None:
        if len(outcomes) >= count:
            return None
        tracker = next((o.tracker for o in reversed(outcomes) if o.launch is not None), None)
        left = num_rollout - (0 if tracker is None else tracker + 1)
        # three quarters of the span: a launch that runs faster than the reference did (it
        # ran beside other tests) still has a rollout left when the kill comes
        return Kill.after(round(rng.uniform(0.0, 0.75 * left * per_rollout), 2), line="plan:")

    return next_kill


# ---------------------------------------------------------------- running


def train_command(
    args: Sequence[object], save_dir: str | Path, nproc: int = 1, subcommand: str = "train"
) -> list[str]:
    save = str(save_dir)
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    return [
        sys.executable,
        *(launcher if nproc > 1 else []),
        "-m",
        "mileage",
        subcommand,
        *map(str, args),
        "--save",
        save,
        "--load",
        save,
        "--save-interval",
        "1",
    ]


def launch(
    args: Sequence[object],
    save_dir: str | Path,
    kill: Kill | None = None,
    *,
    timeout: float = 900.0,
    env: dict[str, str] | None = None,
    nproc: int = 1,
    subcommand: str = "train",
) -> Launch:
    """Run the train command (`subcommand`: train or train-async) once, killed as `kill` says; returns when the process has exited."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MILEAGE_KILL_AT", "MILEAGE_KILL_RANK", "MILEAGE_FAIL_AT", "MILEAGE_SIGNAL_AT")
    }
    full_env.update(env or {})
    # unbuffered, so that output printed before a SIGKILL (the plan line) is not lost with it
    full_env["PYTHONUNBUFFERED"] = "1"
    if kill is not None:
        full_env.update(kill.env())
    outside = kill is not None and kill.delay is not None
    started = time.monotonic()
    proc = subprocess.Popen(
        train_command(args, save_dir, nproc, subcommand),
        start_new_session=True,  # its own process group: a kill from outside takes every rank
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",  # a kill can cut a multi-byte character in half
        env=full_env,
    )
    stdout_times: list[tuple[float, str]] = []
    stderr_parts: list[str] = []
    anchor = kill.after_line if outside else None
    anchored = threading.Event()

    def read_stdout() -> None:
        for line in proc.stdout:
            stdout_times.append((time.monotonic() - started, line))
            if anchor is not None and line.startswith(anchor):
                anchored.set()

    readers = [
        threading.Thread(target=read_stdout, daemon=True),
        threading.Thread(target=lambda: stderr_parts.append(proc.stderr.read()), daemon=True),
    ]
    for reader in readers:
        reader.start()
    timed_out = False
    try:
        if anchor is not None:
            _wait_for_line(proc, anchored, started + timeout)
        proc.wait(timeout=kill.delay if outside else timeout)
    except subprocess.TimeoutExpired:
        timed_out = not outside
        # the whole group (torchrun's workers too); its own returncode stands if it is gone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join(timeout=60)
    stdout = "".join(line for _, line in stdout_times)
    return Launch(
        kill,
        proc.returncode,
        time.monotonic() - started,
        stdout,
        "".join(stderr_parts),
        timed_out,
        stdout_times,
    )


def _wait_for_line(proc: subprocess.Popen, seen: threading.Event, deadline: float) -> None:
    """Until the launch prints the anchor line, exits, or `deadline` (monotonic) passes."""
    while not seen.is_set() and proc.poll() is None and time.monotonic() < deadline:
        seen.wait(timeout=0.05)


def run_uninterrupted(
    args: Sequence[object],
    save_dir: str | Path,
    *,
    timeout: float = 900.0,
    env: dict[str, str] | None = None,
    nproc: int = 1,
    subcommand: str = "train",
) -> Launch:
    """The reference run: one launch into a new `save_dir` that must exit 0."""
    done = launch(args, save_dir, timeout=timeout, env=env, nproc=nproc, subcommand=subcommand)
    if done.returncode != 0 or done.timed_out:
        raise CrashHarnessError(
            f"uninterrupted run exited with {done.returncode}"
            f"{' (timed out)' if done.timed_out else ''}: {done.tail()}"
        )
    return done


def run_with_kills(
    args: Sequence[object],
    save_dir: str | Path,
    kills: Iterable[Kill] | Callable[[list[Outcome]], Kill | None],
    *,
    max_reruns: int = 5,
    timeout: float = 900.0,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    nproc: int = 1,
    subcommand: str = "train",
) -> list[Outcome]:
    """Launch once per kill (each launch resumes from what the previous ones left), then rerun
    the plain command until it exits 0, at most `max_reruns` times; one Outcome per kill.

    `kills` is a sequence, or a function that is given the outcomes so far right before each
    launch and returns the next kill (None: no more kills; it is not asked once the run has
    finished), so that it can aim at what is left of the run. Kills of a sequence whose turn
    comes after the run finished are recorded as not reached. Failures never raise: they land
    in the outcomes' `problems`.
    """
    save_dir = Path(save_dir)
    say = log or (lambda line: None)
    launches: list[Launch] = []
    outcomes: list[Outcome] = []
    owner: list[int] = []  # index into launches of each outcome's launch
    finished = False
    num_rollout: int | None = None

    def record(run: Launch) -> None:
        nonlocal finished, num_rollout
        launches.append(run)
        if run.plan is not None:
            num_rollout = run.plan[1]
        finished = finished or (run.returncode == 0 and not run.timed_out)

    listed = None if callable(kills) else iter(kills)
    while True:
        if listed is not None:
            kill = next(listed, None)
        elif finished:
            break
        else:
            kill = kills(outcomes)
        if kill is None:
            break
        if finished:
            outcomes.append(Outcome(kill, None))
            owner.append(-1)
            say(f"{kill.label}: not reached, the run had finished")
            continue
        run = launch(
            args, save_dir, kill, timeout=timeout, env=env, nproc=nproc, subcommand=subcommand
        )
        record(run)
        outcome = _observe(kill, run, save_dir, num_rollout)
        outcomes.append(outcome)
        owner.append(len(launches) - 1)
        say(
            f"{kill.label}: {outcome.status} after {run.seconds:.1f}s, rollout {outcome.rollout}, "
            f"tracker {outcome.tracker}, logged {outcome.logged}"
        )

    reruns = 0
    while not finished and reruns < max_reruns:
        run = launch(args, save_dir, timeout=timeout, env=env, nproc=nproc, subcommand=subcommand)
        record(run)
        reruns += 1
        say(f"rerun {reruns}: rc {run.returncode} after {run.seconds:.1f}s")

    for outcome, index in zip(outcomes, owner, strict=True):
        if index >= 0:
            _judge(outcome, launches, index, finished, max_reruns)
    return outcomes


def _observe(kill: Kill, run: Launch, save_dir: Path, num_rollout: int | None) -> Outcome:
    """Read what the killed (or finished, or failed) launch left on disk."""
    tracker = read_tracker(save_dir).iteration
    logged = _last_logged(save_dir)
    outcome = Outcome(
        kill,
        run,
        tracker=tracker,
        logged=logged,
        rollout=_hit_rollout(kill, save_dir, tracker, logged, num_rollout),
        expected_start=_expected_start(save_dir, tracker),
    )
    if tracker is not None:
        problems = verify_checkpoint(checkpoint_path(save_dir, tracker))
        outcome.intact = not problems
        outcome.problems += [f"after the kill: {p}" for p in problems]
    elif read_tracker(save_dir).exists:
        outcome.intact = False
        outcome.problems.append("after the kill: the tracker is unreadable")
    if not run.died_by_kill and run.returncode != 0:
        outcome.problems.append(
            f"the killed launch exited with {run.returncode}"
            f"{' (timed out)' if run.timed_out else ''}: {run.tail()}"
        )
    return outcome


def _committed(save_dir: Path, tracker: int | None) -> int | None:
    """The checkpoint the next launch resumes from: the tracked one, or, when a kill came
    between a checkpoint's rename and the tracker's move (no tracker yet), the newest complete
    one (the plan's latest-complete discovery); None when nothing was committed."""
    if tracker is not None or read_tracker(save_dir).exists:
        return tracker
    state = scan_dir(save_dir)
    return state.complete_ids[-1] if state is not None and state.complete_ids else None


def _expected_start(save_dir: Path, tracker: int | None) -> int:
    """Where the next launch must start: after the checkpoint it resumes from, else at 0."""
    committed = _committed(save_dir, tracker)
    return 0 if committed is None else committed + 1


def _judge(
    outcome: Outcome, launches: list[Launch], index: int, finished: bool, max_reruns: int
) -> None:
    """Fill in `resumed_at` / `resumed` from the launches after this outcome's own."""
    later = launches[index + 1 :]
    for run in later:
        if run.plan is not None:
            outcome.resumed_at = run.plan[0]
            break
    own = launches[index]
    if own.returncode == 0 and not own.timed_out:
        outcome.resumed = True  # the run finished before the kill: nothing to resume
        return
    for run in later:
        if not (run.died_by_kill or run.returncode in (0, STOPPED_EXIT)):
            outcome.problems.append(
                f"a later launch ({run.kill.label if run.kill else 'plain rerun'}) exited with "
                f"{run.returncode}{' (timed out)' if run.timed_out else ''}: {run.tail()}"
            )
    if not finished:
        outcome.problems.append(f"the run did not finish within {max_reruns} plain reruns")
    if outcome.resumed_at is not None and outcome.resumed_at != outcome.expected_start:
        outcome.problems.append(
            f"the next launch started at rollout {outcome.resumed_at}, "
            f"expected {outcome.expected_start}"
        )
    outcome.resumed = (
        finished
        and outcome.resumed_at == outcome.expected_start
        and all(r.died_by_kill or r.returncode in (0, STOPPED_EXIT) for r in later)
    )


def _last_logged(save_dir: Path) -> int | None:
    path = save_dir / METRICS_FILE
    if not path.is_file():
        return None
    ids = []
    for line in path.read_text().splitlines():
        try:
            ids.append(json.loads(line)["rollout_id"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line is the resuming run's business, not the observer's
    return max(ids) if ids else None


def _hit_rollout(
    kill: Kill, save_dir: Path, tracker: int | None, logged: int | None, num_rollout: int | None
) -> int:
    resumed_from = _committed(save_dir, tracker)
    committed = -1 if resumed_from is None else resumed_from
    first_unlogged = 0 if logged is None else logged + 1
    if kill.point in COMMITTED_SAVE_POINTS:
        return committed
    if kill.point in RENAMED_SAVE_POINTS:  # the checkpoint being saved is complete on disk
        state = scan_dir(save_dir)
        return state.complete_ids[-1] if state is not None and state.complete_ids else committed
    if kill.point in PPO_SAVE_POINTS:
        return committed + 1
    if kill.point == "after_metrics":
        return first_unlogged - 1
    if kill.point is None and num_rollout is not None:
        # all rollouts logged: the kill hit the saving of the last ones
        return min(first_unlogged, num_rollout - 1)
    return first_unlogged


# ---------------------------------------------------------------- reporting


def outcome_table(outcomes: Sequence[Outcome], first_number: int = 1) -> str:
    """The outcomes as a markdown table."""
    rows = [
        "| kill # | kill point | rollout | tracker after | outcome | resumed |",
        "|---:|---|---:|---:|---|---|",
    ]
    for number, o in enumerate(outcomes, first_number):
        resumed = "-" if o.launch is None else ("OK" if o.resumed else "FAILED")
        if o.launch is not None and o.resumed_at is not None and o.died:
            resumed += f" (at {o.resumed_at})"
        rows.append(
            f"| {number} | {o.kill.label} | {_dash(o.rollout if o.launch else None)} | "
            f"{_dash(o.tracker)} | {o.status} | {resumed} |"
        )
    return "\n".join(rows)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
