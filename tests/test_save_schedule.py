"""The headline promise by default: with --save, a run saves every tenth of its rollouts or 5
minutes of work, whichever comes first, says so in its plan, and the README's own command
killed with -9 past the first tenth resumes from a save, not from rollout 0."""

from __future__ import annotations

import datetime
import os
import random
import subprocess
import sys

import pytest
import test_readme as readme
from conftest import REPO

from mileage.checkpoint import schedule as schedule_module
from mileage.checkpoint.config import CheckpointConfig
from mileage.checkpoint.schedule import build_schedule
from mileage.cli.main import main


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(schedule_module.time, "monotonic", clock)
    return clock


def test_the_default_saves_every_tenth_of_the_run_and_after_the_last(clock):
    schedule = build_schedule(150, None, None)
    due = [r for r in range(150) if schedule.due(r)]
    assert due == list(range(14, 150, 15)), due
    assert schedule.describe() == (
        "  saves: every 15 rollout(s) (a tenth of 150) or after 5 min of unsaved work "
        "(--save-interval-minutes), whichever comes first, and after the last rollout"
    )
    # a short run saves after every rollout: a tenth of 3 rounds up to one
    assert [r for r in range(3) if build_schedule(3, None, None).due(r)] == [0, 1, 2]


def test_five_minutes_of_unsaved_work_make_a_save_due_and_a_save_resets_the_clock(clock):
    asked = []
    schedule = build_schedule(1000, None, None, agree=lambda due: asked.append(due) or due)
    assert not schedule.due(0)
    clock.now += 5 * 60 - 1
    assert not schedule.due(1)
    clock.now += 1
    assert schedule.due(2) and asked[-1] is True  # the ranks are asked to agree
    schedule.saved()
    assert not schedule.due(3)
    assert not build_schedule(1000, None, 0).due(3)  # 0: never by the clock


def test_an_explicit_save_interval_is_miles_meaning_and_has_no_clock(clock):
    schedule = build_schedule(100, 7, None)
    clock.now += 3600
    assert [r for r in range(100) if schedule.due(r)] == [*range(6, 100, 7), 99]
    assert schedule.describe() == (
        "  saves: every 7 rollout(s) (--save-interval), and after the last rollout"
    )
    assert build_schedule(100, 7, 2).minutes == 2  # unless the clock is asked for too


def test_the_plan_line_warns_when_nothing_is_saved():
    assert "warning: no --save" in CheckpointConfig().schedule_line(10)
    read_only = CheckpointConfig(load="runs/demo").schedule_line(10)
    assert "--load runs/demo is only read" in read_only
    assert CheckpointConfig(no_save=True).schedule_line(10) == "  saves: nothing (--no-save)"


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--save", ""], "--save is empty"),
        (["--save", "x", "--no-save"], "contradict"),
        (["--save", "x", "--save-interval-minutes", "-1"], "--save-interval-minutes must be"),
    ],
)
def test_bad_save_flags_are_one_line(capsys, flags, said):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


def test_the_quick_start_killed_past_a_tenth_resumes_from_a_save(builtin_model, tmp_path):
    """The README's first command, SIGKILLed at a random rollout past the first tenth of its run
    (seeded by the day, printed), is planned to resume no further back than a tenth."""
    command = [*readme.quick_start_command(), "--num-threads", "1"]
    seed = os.environ.get("MILEAGE_TEST_SEED") or datetime.date.today().isoformat()
    kill_after = random.Random(seed).randint(16, 45)
    print(f"killing after rollout {kill_after}")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MILEAGE_KILL_AT": f"after_train:{kill_after + 1}",
    }
    killed = subprocess.run(
        [sys.executable, "-m", "mileage", *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "  saves: every 15 rollout(s) (a tenth of 150)" in killed.stdout
    replanned = subprocess.run(
        [sys.executable, "-m", "mileage", "plan", *command[1:]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert replanned.returncode == 0, replanned.stderr[-2000:]
    start = int(replanned.stdout.split("resume at rollout ", 1)[1].split()[0])
    assert kill_after + 1 - 15 <= start <= kill_after, (kill_after, replanned.stdout)
