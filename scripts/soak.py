"""Crash-anywhere soak: many SIGKILLs at random named points and random instants.

    python scripts/soak.py --kills 200 --seed 0 --out docs/soak.md
    python scripts/soak.py --nproc 2 --kills 100 --seed 0 --out docs/soak_distributed.md

Runs chains of launches of one small `mileage train` command (sync or async saves, chosen per
chain): each launch is killed at a random named fault point and hit (always one the remaining
run reaches) or after a random delay, the next launch resumes, and when the chain's kills are
spent the command is rerun until it exits 0. Each finished chain is compared with an
uninterrupted run of the same command, every checkpoint tensor with `torch.equal`. Prints one
row per kill and a summary, and writes both as markdown with `--out`.

With `--train-async one-step|fully` every launch is `mileage train-async` (one-step-off, or
fully async with a staleness bound its weight-update interval exceeds, so stale groups are
retried), and the named kills include the async points (slot N+1 generating while N trains,
before and in the middle of a weight sync):

    python scripts/soak.py --train-async one-step --kills 100 --seed 0 --out docs/soak_async.md

With `--nproc N` every launch is `torchrun --nproc-per-node N --standalone -m mileage train`
(sync saves only: --async-save is refused under torchrun). A named kill dies on one rank, drawn
at random among those that reach the point (the commit after the shards runs on rank 0 alone);
torchrun stops the others. A random-time kill SIGKILLs torchrun and every rank at once.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mileage.checkpoint.layout import read_tracker
from mileage.testing.compare import compare_runs, count_tensor_differences
from mileage.testing.crash import run_uninterrupted, run_with_kills
from mileage.testing.kills import (
    ASYNC_POINTS,
    KILL_POINTS,
    SAVE_POINTS,
    STEPS_PER_ROLLOUT,
    Kill,
    Outcome,
    crash_run_args,
)


@dataclass
class Chain:
    number: int
    async_save: bool
    budget: int
    outcomes: list[Outcome] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return all(o.resumed for o in self.outcomes)

    @property
    def mode(self) -> str:
        return "async" if self.async_save else "sync"


# under torchrun only these points are reached by every rank; the rest of the commit (after
# the shards are written) runs on rank 0 alone
EVERY_RANK_POINTS = frozenset(KILL_POINTS) - frozenset(SAVE_POINTS) | {
    "save_after_model",
    "save_after_optimizer",
}


class KillChooser:
    """Picks each next kill from what is left of the run, so that named kills are reached."""

    def __init__(
        self,
        rng: random.Random,
        save: Path,
        budget: int,
        num_rollout: int,
        named_fraction: float,
        max_delay: float,
        nproc: int = 1,
        points: tuple[str, ...] = KILL_POINTS,
    ):
        self.nproc = nproc
        self.points = points
        self.rng, self.save, self.budget = rng, save, budget
        self.num_rollout, self.named_fraction, self.max_delay = (
            num_rollout,
            named_fraction,
            max_delay,
        )

    def __call__(self, outcomes: list[Outcome]) -> Kill | None:
        if len(outcomes) >= self.budget:
            return None
        if outcomes and not outcomes[-1].died and outcomes[-1].problems:
            return None  # a launch failed: the chain is broken, its reruns will say how
        tracker = read_tracker(self.save).iteration
        left = self.num_rollout - (0 if tracker is None else tracker + 1)
        if left <= 0:
            return None  # every rollout is committed: nothing left to kill, the rerun finishes
        if self.rng.random() < self.named_fraction:
            point = self.rng.choice(self.points)
            per_rollout = STEPS_PER_ROLLOUT if point == "optimizer_step" else 1
            hit = self.rng.randint(1, max(1, left * per_rollout))
            ranks = self.nproc if point in EVERY_RANK_POINTS else 1
            return Kill.at(point, hit, rank=self.rng.randrange(ranks))
        # a launch with less left to do finishes sooner: aim the delay at its lifetime
        horizon = self.max_delay * (0.5 + 0.5 * left / self.num_rollout)
        return Kill.after(round(self.rng.uniform(0.0, horizon), 2))


# `--train-async`: the flags added to the crash run, and the points only train-async reaches
ASYNC_MODES = {
    "one-step": [],
    "fully": [
        "--fully-async",
        "--max-weight-staleness", "1",
        "--update-weights-interval", "2",
        "--async-unused-samples-handler", "retry",
    ],
}  # fmt: skip


def run_args(options, async_save: bool) -> list[str]:
    extra = ASYNC_MODES[options.train_async] if options.train_async else []
    return [*crash_run_args(options.num_rollout, async_save), *extra]


def subcommand(options) -> str:
    return "train-async" if options.train_async else "train"


def kill_points(options) -> tuple[str, ...]:
    if options.train_async:
        return KILL_POINTS
    return tuple(p for p in KILL_POINTS if p not in ASYNC_POINTS)


def run_chain(chain: Chain, options, workdir: Path, references: dict[bool, Path], log) -> Chain:
    rng = random.Random(f"{options.seed}/chain/{chain.number}")
    save = workdir / f"chain{chain.number:03d}"
    chooser = KillChooser(
        rng,
        save,
        chain.budget,
        options.num_rollout,
        options.named_fraction,
        options.max_delay_factor * references["seconds"],
        options.nproc,
        kill_points(options),
    )
    started = time.monotonic()
    chain.outcomes = run_with_kills(
        run_args(options, chain.async_save),
        save,
        chooser,
        max_reruns=options.max_reruns,
        log=lambda line: log(f"chain {chain.number} ({chain.mode}): {line}"),
        nproc=options.nproc,
        subcommand=subcommand(options),
    )
    chain.diffs = compare_runs(references[chain.async_save], save)
    chain.seconds = time.monotonic() - started
    if not options.keep:
        shutil.rmtree(save, ignore_errors=True)
    log(
        f"chain {chain.number} ({chain.mode}): {len(chain.outcomes)} kills, "
        f"{'finished' if chain.finished else 'NOT finished'}, {len(chain.diffs)} differences, "
        f"{chain.seconds:.0f}s"
    )
    return chain


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} logical CPUs "
        f"(shared with other jobs), Python {platform.python_version()}, torch {torch.__version__}"
    )


def report(chains: list[Chain], options, command: str, started: float, loads) -> str:
    rows = [
        "| kill # | chain | save | kill point | rollout | tracker after | outcome | resumed |",
        "|---:|---:|---|---|---:|---:|---|---|",
    ]
    number = 0
    for chain in chains:
        for o in chain.outcomes:
            number += 1
            resumed = "-" if o.launch is None else ("OK" if o.resumed else "FAILED")
            rollout = "-" if o.launch is None or o.rollout is None else o.rollout
            tracker = "-" if o.tracker is None else o.tracker
            label = o.kill.label
            if options.nproc > 1 and o.kill.point is not None:
                label += f" (rank {o.kill.rank})"
            rows.append(
                f"| {number} | {chain.number} | {chain.mode} | {label} | {rollout} | "
                f"{tracker} | {o.status} | {resumed} |"
            )
    outcomes = [o for chain in chains for o in chain.outcomes]
    named = [o for o in outcomes if o.kill.point is not None]
    timed = [o for o in outcomes if o.kill.point is None]
    died = [o for o in outcomes if o.died]
    tensor_diffs = sum(count_tensor_differences(c.diffs) for c in chains)
    other_diffs = sum(len(c.diffs) for c in chains) - tensor_diffs
    summary = [
        f"- kills: {len(outcomes)} ({len(named)} at named points, {len(timed)} at random times)",
        f"- died by the kill (returncode -9): {len(died)} "
        f"(named {sum(o.died for o in named)} of {len(named)}, "
        f"random-time {sum(o.died for o in timed)} of {len(timed)})",
        f"- finished before the kill: {sum(o.status == 'finished first' for o in outcomes)}",
        f"- launches that failed: {sum(o.status.startswith('failed') for o in outcomes)}",
        f"- resumed OK after the kill: {sum(o.resumed for o in died)} of {len(died)}",
        f"- chains: {len(chains)} ({sum(c.async_save for c in chains)} with --async-save), "
        f"finished: {sum(c.finished for c in chains)}, "
        f"identical to the uninterrupted run: {sum(not c.diffs for c in chains)}",
        f"- differing tensors: {tensor_diffs}; other differences: {other_diffs}",
        f"- wall time: {time.monotonic() - started:.0f}s; load average at start / end: "
        f"{loads[0]} / {loads[1]}",
    ]
    problems = [
        f"- chain {c.number} kill {o.kill.label}: {p}"
        for c in chains
        for o in c.outcomes
        for p in o.problems
    ]
    problems += [f"- chain {c.number}: {d}" for c in chains for d in c.diffs[:20]]
    sections = [
        "# Crash-anywhere soak",
        "",
        f"Every kill is a SIGKILL of `mileage {subcommand(options)}`, at a named fault point (`MILEAGE_KILL_AT`, "
        "the process kills itself at the hit-th time it reaches the point) or at a random delay "
        "after launch (killed from outside). After each kill the same command is rerun; each "
        "chain of kills ends by rerunning it until it exits 0, and the result is compared with "
        "an uninterrupted run of the same command: every model, optimizer and RNG tensor of "
        "every checkpoint with `torch.equal`, trainer state, meta.json (minus time and host), "
        "and metrics.jsonl minus timing keys. `rollout` is the rollout the kill hit (for a save "
        "point, the rollout being saved); `tracker after` is the last committed rollout.",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}",
        "",
        *([options.note, ""] if options.note else []),
        f"Run settings: `{launcher(options.nproc)}mileage {subcommand(options)} "
        f"{' '.join(run_args(options, False))} "
        f"{'' if options.nproc > 1 else '[--async-save] '}--save D --load D --save-interval 1` "
        "(built-in model)",
        "",
        "## Summary",
        "",
        *summary,
        "",
    ]
    if problems:
        sections += ["## Problems", "", *problems, ""]
    sections += ["## Kills", "", *rows, ""]
    return "\n".join(sections)


def launcher(nproc: int) -> str:
    return f"torchrun --nproc-per-node {nproc} --standalone -m " if nproc > 1 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200, help="kill events in total")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the report here as markdown")
    parser.add_argument("--num-rollout", type=int, default=6)
    parser.add_argument("--max-kills-per-chain", type=int, default=16)
    parser.add_argument("--named-fraction", type=float, default=0.75)
    parser.add_argument(
        "--max-delay-factor",
        type=float,
        default=1.0,
        help="random-time kills come within this many uninterrupted-run durations of launch",
    )
    parser.add_argument("--max-reruns", type=int, default=3)
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes per launch (torchrun above 1; sync saves)"
    )
    parser.add_argument(
        "--train-async",
        choices=sorted(ASYNC_MODES),
        help="soak `mileage train-async` (one-step-off or fully async) instead of `train`",
    )
    parser.add_argument("--jobs", type=int, default=1, help="chains run at the same time")
    parser.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep each chain's save directory")
    parser.add_argument("--note", default="", help="a line for the report (e.g. the commit)")
    options = parser.parse_args(argv)
    if options.train_async and options.nproc > 1:
        parser.error(
            "--train-async soaks the in-process engine, which train-async refuses under torchrun"
        )
    command = shlex.join(["python", "scripts/soak.py", *(argv or sys.argv[1:])])

    started = time.monotonic()
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="mileage-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def log(line: str) -> None:
        with lock:
            print(f"[{time.monotonic() - started:6.0f}s] {line}", flush=True)

    references: dict = {}
    modes = (False,) if options.nproc > 1 else (False, True)
    for async_save in modes:
        done = run_uninterrupted(
            run_args(options, async_save),
            workdir / f"reference-{async_save}",
            nproc=options.nproc,
            subcommand=subcommand(options),
        )
        references[async_save] = workdir / f"reference-{async_save}"
        references["seconds"] = max(references.get("seconds", 0.0), done.seconds)
        log(f"uninterrupted run ({'async' if async_save else 'sync'}): {done.seconds:.1f}s")

    rng = random.Random(options.seed)

    def async_chain() -> bool:
        drawn = rng.random() < 0.5  # drawn either way: --nproc leaves the seed's kills as they were
        return drawn and options.nproc == 1

    chains, planned = [], 0
    while planned < options.kills:
        budget = min(options.kills - planned, rng.randint(4, options.max_kills_per_chain))
        chains.append(Chain(len(chains) + 1, async_chain(), budget))
        planned += budget

    def one(chain: Chain) -> Chain:
        return run_chain(chain, options, workdir, references, log)

    # a chain can end before its budget (the run finished first), so top up with more chains
    done_chains: list[Chain] = []
    while chains:
        with ThreadPoolExecutor(max_workers=options.jobs) as pool:
            done_chains += list(pool.map(one, chains))
        # count only kills that killed, so the table holds at least --kills of them
        spent = sum(1 for c in done_chains for o in c.outcomes if o.died)
        chains = []
        while spent < options.kills:
            budget = min(options.kills - spent, rng.randint(4, options.max_kills_per_chain))
            chains.append(Chain(len(done_chains) + len(chains) + 1, async_chain(), budget))
            spent += budget

    load_end = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(done_chains, options, command, started, (load_start, load_end))
    print(text)
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(text)
    if not options.keep and options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    clean = all(c.finished and not c.diffs for c in done_chains)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
