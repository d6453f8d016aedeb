"""Wall time of `mileage` commands that should answer at once: `--help`, `train --help` and
`ckpt ls` (of an empty save directory and of one holding a checkpoint), and of a short run (the
crash harness's six rollouts of the built-in model, saving each: what most test launches
are), each a fresh process.

`--baseline COMMIT` checks that commit out in a temporary git worktree and times it in the same
run, command by command and repetition by repetition interleaved with this checkout, so both
see the same machine load. Each tree runs as `python -m mileage` from its own root (on
PYTHONPATH, so the installed copy is not what runs); one untimed launch per command first
compiles its .pyc files.

    python bench/cli_startup.py --baseline de6f910 --reps 5
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    REPO,
    cpu_description,
    load_average,
    median,
    output_path,
    print_table,
    spread,
    write_results,
)

from mileage.testing.kills import crash_run_args


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def describe_tree(tree: Path) -> str:
    """The commit a tree is at, with `+changes` when its tracked files differ from it."""
    sha = git("rev-parse", "--short", "HEAD", cwd=tree)
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    return f"{sha}+changes" if dirty else sha


def launch(tree: Path, args: list[str]) -> float:
    """Seconds `python -m mileage ARGS` takes with `tree`'s code; exit 0 required."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mileage", *args],
        cwd=tree,  # sys.path[0] of `-m` is the working directory: this tree's mileage
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"mileage {' '.join(args)} in {tree} failed:\n{done.stderr[-2000:]}")
    return seconds


def checkpoint_dir(scratch: Path) -> Path:
    """A save directory holding one checkpoint: the built-in model converted to SAVE/release."""
    from mileage.rollout.builtin_model import ensure_builtin_model

    save = scratch / "release_run"
    done = subprocess.run(
        [sys.executable, "-m", "mileage", "convert", "--hf-checkpoint"]
        + [str(ensure_builtin_model("addition", log=lambda *_: None)), "--save", str(save)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"mileage convert failed:\n{done.stderr[-2000:]}")
    return save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a commit to time side by side (git worktree)")
    parser.add_argument("--reps", type=int, default=5, help="timed launches per command and tree")
    parser.add_argument(
        "--ckpt-dir", help="save directory for `ckpt ls` (default: the built-in model converted)"
    )
    parser.add_argument("--out", default="cli_startup", help="results JSON (bench/results/)")
    opts = parser.parse_args()
    out = output_path(opts.out)
    with tempfile.TemporaryDirectory(prefix="mileage-cli-startup-") as tmp:
        scratch = Path(tmp)
        trees = {f"this checkout ({describe_tree(REPO)})": REPO}
        if opts.baseline:
            base = scratch / "baseline"
            git("worktree", "add", "--detach", str(base), opts.baseline)
            trees[f"baseline ({describe_tree(base)})"] = base
        try:
            (scratch / "empty_run").mkdir()
            ckpt = Path(opts.ckpt_dir) if opts.ckpt_dir else checkpoint_dir(scratch)
            runs = itertools.count()  # every short run starts fresh, in a save dir of its own
            short_run = [*crash_run_args(), "--save-interval", "1", "--save"]
            commands = {
                "mileage --help": lambda: ["--help"],
                "mileage train --help": lambda: ["train", "--help"],
                "mileage ckpt ls EMPTY_DIR": lambda: ["ckpt", "ls", str(scratch / "empty_run")],
                "mileage ckpt ls CKPT_DIR": lambda: ["ckpt", "ls", str(ckpt)],
                "mileage train CRASH_RUN_ARGS": lambda: [
                    "train",
                    *short_run,
                    str(scratch / f"run{next(runs)}"),
                ],
            }
            load_before = load_average()
            for args in commands.values():  # untimed: compiles each tree's .pyc files
                for tree in trees.values():
                    launch(tree, args())
            times = {(c, t): [] for c in commands for t in trees}
            for _ in range(opts.reps):
                for command, args in commands.items():
                    for name, tree in trees.items():
                        times[command, name].append(launch(tree, args()))
        finally:
            if opts.baseline:
                git("worktree", "remove", "--force", str(scratch / "baseline"))
    rows = [
        {"command": c, "tree": t, "median": median(v), "spread": spread(v)}
        for (c, t), v in times.items()
    ]
    columns = [("command", "command"), ("tree", "code"), ("median", "median s")]
    table = print_table(rows, [*columns, ("spread", "min-max s")])
    payload = {
        "cpu": cpu_description(),
        "python": sys.version.split()[0],
        "load_average": {"before": load_before, "after": load_average()},
        "reps": opts.reps,
        "ckpt_dir": "built-in model converted (release)" if not opts.ckpt_dir else str(ckpt),
        "seconds": {f"{c} | {t}": v for (c, t), v in times.items()},
        "table": table,
    }
    write_results(out, payload)


if __name__ == "__main__":
    main()
