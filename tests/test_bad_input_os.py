"""Paths the OS refuses: one line naming the flag, the path and the OS's reason, exit code 2,
no traceback. Tests run as root, whom permission bits do not stop: the unwritable places here
are /proc (no new entries there) and paths under a regular file."""

from __future__ import annotations

import errno
import json
import os

import pytest

from mileage.checkpoint.lock import LOCK_FILE, SaveDirLock
from mileage.cli import ckpt_commands
from mileage.cli.main import main
from mileage.errors import UserError


def one_line_error(capsys, argv: list) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("mileage: error: "), err
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_a_save_directory_that_cannot_be_made_is_refused_before_anything_runs(
    command, capsys, a_file
):
    line = one_line_error(capsys, [command, "--save", "/proc/mileage-test", "--num-threads", "1"])
    assert "cannot create --save directory /proc/mileage-test: " in line
    line = one_line_error(capsys, [command, "--save", a_file / "run", "--num-threads", "1"])
    assert f"cannot create --save directory {a_file}/run: {a_file} is a file" in line


def test_a_lock_path_that_is_a_directory_is_named(tmp_path):
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(UserError, match=f"cannot open the lock file {tmp_path / LOCK_FILE}: "):
        SaveDirLock(tmp_path).acquire()


def test_a_save_directory_the_lock_cannot_create_is_named(a_file):
    with pytest.raises(UserError, match=f"cannot create --save directory {a_file}/run: "):
        SaveDirLock(a_file / "run").acquire()


def test_export_and_convert_outputs_are_checked_before_reading_anything(capsys, tmp_path, a_file):
    # --load and --hf-checkpoint do not exist: the output is refused first, not after the work
    out = ["export-hf", "--load", tmp_path / "no-run", "--out", "/proc/mileage-test/hf"]
    assert "cannot create --out directory /proc/mileage-test/hf: " in one_line_error(capsys, out)
    convert = ["convert", "--hf-checkpoint", tmp_path / "no-model", "--save", a_file / "s"]
    line = one_line_error(capsys, convert)
    assert f"cannot create --save directory {a_file}/s: {a_file} is a file" in line


def test_a_plot_that_cannot_be_written_is_named(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0, "reward_mean": 0.5}))
    line = one_line_error(capsys, ["plot", tmp_path, "--out", "/proc/mileage-test.png"])
    assert "cannot write --out /proc/mileage-test.png: " in line


def test_an_os_error_no_check_caught_is_one_line_naming_reason_and_file(
    monkeypatch, capsys, tmp_path
):
    def disk_full(args) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x"))

    monkeypatch.setattr(ckpt_commands, "_ls", disk_full)
    line = one_line_error(capsys, ["ckpt", "ls", tmp_path])
    assert line == f"mileage: error: No space left on device: {tmp_path / 'x'}"
