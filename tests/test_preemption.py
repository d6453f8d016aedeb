"""SIGTERM/SIGINT, a second signal, the save-trigger sentinel, and the one-writer lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, fast_train_args

from mileage.checkpoint.inspect import verify_save_dir
from mileage.checkpoint.layout import read_tracker
from mileage.checkpoint.lock import LOCK_FILE, SaveDirLock
from mileage.preemption import STOPPED_EXIT


def start_train(args: list, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "mileage", "train", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 300) -> list[str]:
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}; output: {''.join(seen)}{proc.stderr.read()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_exits_75_then_the_same_command_resumes(cli, tiny_hf, tmp_path, sig):
    save = tmp_path / "run"
    args = [*fast_train_args(tiny_hf), "--num-rollout", 1000, "--save", save, "--load", save]
    proc = start_train(args)
    wait_for_line(proc, "rollout 1 |")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_EXIT, err  # stopped early, resumable: not a success
    stopped = [line for line in out.splitlines() if line.startswith("stopped after rollout")]
    assert len(stopped) == 1 and sig.name in stopped[0], out
    last = int(stopped[0].split()[3])
    assert f"resume at rollout {last + 1}" in stopped[0]
    assert read_tracker(save).iteration == last
    again = cli(
        "train",
        *fast_train_args(tiny_hf),
        "--num-rollout",
        last + 2,
        "--save",
        save,
        "--load",
        save,
    )
    assert again.returncode == 0, again.stderr
    assert f"resume at rollout {last + 1} of {last + 2}" in again.stdout


def test_second_signal_exits_at_once_without_corruption(tiny_hf, tmp_path):
    save = tmp_path / "run"
    # rollouts of seconds, so the second signal lands while the first rollout is still running
    heavy = ["--rollout-batch-size", 64, "--n-samples-per-prompt", 8]
    heavy += ["--rollout-max-response-len", 56, "--save-interval", 1, "--num-rollout", 1000]
    proc = start_train([*fast_train_args(tiny_hf), *heavy, "--save", save, "--load", save])
    wait_for_line(proc, "rollout 2 |")
    proc.send_signal(signal.SIGTERM)
    assert "SIGTERM received" in proc.stderr.readline() + proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "second SIGTERM" in err
    checked, problems = verify_save_dir(save)
    assert problems == [] and checked, problems
    assert read_tracker(save).iteration is not None


def test_sentinel_file_triggers_a_save_and_is_deleted(cli, tiny_hf, tmp_path):
    save, sentinel = tmp_path / "run", tmp_path / "save-now"
    sentinel.touch()
    done = cli(
        "train",
        *fast_train_args(tiny_hf),
        "--num-rollout",
        3,
        "--save",
        save,
        "--load",
        save,
        "--save-trigger-sentinel",
        sentinel,
        "--save-interval",  # no scheduled save before the last rollout: only the sentinel's
        100,
    )
    assert done.returncode == 0, done.stderr
    assert not sentinel.exists()
    # saved after rollout 0 because of the sentinel, after rollout 2 because it is the last
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000000", "iter_0000002"]


def test_second_writer_is_refused_naming_the_holder(cli, tiny_hf, tmp_path):
    save = tmp_path / "run"
    with SaveDirLock(save):
        busy = cli("train", *fast_train_args(tiny_hf), "--num-rollout", 1, "--save", save)
    assert busy.returncode == 2
    assert f"pid {os.getpid()}" in busy.stderr and socket.gethostname() in busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1
    assert not list(save.glob("iter_*"))


def test_stale_lock_of_a_dead_process_is_taken_over(cli, tiny_hf, tmp_path):
    save = tmp_path / "run"
    save.mkdir()
    (save / LOCK_FILE).write_text(
        json.dumps({"pid": 999999, "host": "gone-host", "since": "earlier"})
    )
    done = cli(
        "train", *fast_train_args(tiny_hf), "--num-rollout", 1, "--save", save, "--load", save
    )
    assert done.returncode == 0, done.stderr
    assert "took over a stale lock" in done.stdout and "999999" in done.stdout
    assert read_tracker(save).iteration == 0


# ---------------------------------------------------------------- preemption is exact


@pytest.mark.slow
def test_sigterm_stopped_run_rerun_equals_the_uninterrupted_run(crash_reference, tmp_path):
    from mileage.testing.compare import compare_runs
    from mileage.testing.crash import launch
    from mileage.testing.kills import crash_run_args

    reference, _ = crash_reference
    save, args = tmp_path / "run", crash_run_args()
    # a SIGTERM from outside, while rollout 2 runs (after the line of rollout 1)
    proc = start_train([*args, "--save", save, "--load", save, "--save-interval", 1])
    wait_for_line(proc, "rollout 1 |")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == STOPPED_EXIT, err
    stopped = [line for line in out.splitlines() if line.startswith("stopped after rollout")]
    assert len(stopped) == 1, out
    last = int(stopped[0].split()[3])
    assert read_tracker(save).iteration == last and last <= 3
    # and one that lands at a known place: while rollout `last + 1` trains
    signalled = launch(args, save, env={"MILEAGE_SIGNAL_AT": "optimizer_step:SIGTERM:1"})
    assert signalled.returncode == STOPPED_EXIT, signalled.tail()
    assert f"stopped after rollout {last + 1} (SIGTERM)" in signalled.stdout
    rerun = launch(args, save)
    assert rerun.returncode == 0, rerun.tail()
    assert f"resume at rollout {last + 2} of 6" in rerun.stdout
    assert compare_runs(reference, save) == []


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_second_signal_inside_a_save_leaves_a_state_that_resumes_exactly(
    crash_reference, crash_reference_async, tmp_path, async_save
):
    from mileage.testing.compare import compare_runs
    from mileage.testing.crash import launch
    from mileage.testing.kills import crash_run_args

    reference = crash_reference_async if async_save else crash_reference[0]
    save, args = tmp_path / "run", crash_run_args(async_save=async_save)
    # first SIGTERM while rollout 1 trains; the second inside that rollout's save (the 2nd save
    # of the launch), after the model is written and before anything commits
    env = {"MILEAGE_SIGNAL_AT": "optimizer_step:SIGTERM:3,save_after_model:SIGTERM:2"}
    stopped = launch(args, save, env=env)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.tail()
    assert "second SIGTERM" in stopped.stderr
    assert read_tracker(save).iteration == 0
    checked, problems = verify_save_dir(save)
    assert problems == [] and checked == ["iter_0000000"], problems
    rerun = launch(args, save)
    assert rerun.returncode == 0, rerun.tail()
    assert "resume at rollout 1 of 6" in rerun.stdout
    assert compare_runs(reference, save) == []


def test_the_first_signals_wait_is_bounded_by_the_grace_period():
    """A rollout that never ends (a hung engine) does not hold a SIGTERM forever: past
    --stop-grace-seconds the process exits 75 with one line, and a loop that reaches its save
    in time cancels the timer."""
    hung = (
        "import os, signal, time\n"
        "from mileage.preemption import PreemptionGuard\n"
        "with PreemptionGuard(grace=0.5) as guard:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", hung], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == STOPPED_EXIT, done.stderr
    assert "did not finish within 0.5 s (--stop-grace-seconds)" in done.stderr
    in_time = hung.replace("time.sleep(60)", "assert guard.stop_requested\n    time.sleep(1.5)")
    done = subprocess.run(
        [sys.executable, "-c", in_time], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0 and "did not finish" not in done.stderr, done.stderr
