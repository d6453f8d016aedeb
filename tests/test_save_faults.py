"""Faults while saving: disk full, I/O error, permission denied, files deleted under the run,
and a kill in the middle of a commit (sync and async). The previous checkpoint always survives."""

from __future__ import annotations

import shutil

import pytest
from conftest import fast_train_args

from mileage.checkpoint.inspect import list_checkpoints, verify_save_dir
from mileage.checkpoint.layout import STAGING_PREFIX, read_tracker


@pytest.fixture(scope="module")
def after_one_rollout(tiny_hf, tmp_path_factory, mileage_home):
    """A save directory holding iter_0000000, made once and copied by each test."""
    from conftest import run_cli

    save = tmp_path_factory.mktemp("one") / "run"
    first = run_cli(*train_args(tiny_hf, save, "--num-rollout", 1))
    assert first.returncode == 0, first.stderr
    return save


def train_args(tiny_hf, save, *extra):
    return [
        "train",
        *fast_train_args(tiny_hf),
        "--save-interval",
        1,
        "--save",
        save,
        "--load",
        save,
        *extra,
    ]


@pytest.mark.parametrize("fault", ["ENOSPC", "EIO", "EACCES", "DELETE"])
@pytest.mark.parametrize("point", ["save_after_model", "commit_before_rename"])
def test_write_fault_stops_with_one_line_and_keeps_previous_checkpoint(
    cli, tiny_hf, tmp_path, after_one_rollout, fault, point
):
    save = shutil.copytree(after_one_rollout, tmp_path / "run")
    before = list_checkpoints(save)
    # the 1st save of the second run (rollout 1) fails
    failed = cli(
        *train_args(tiny_hf, save, "--num-rollout", 3), env={"MILEAGE_FAIL_AT": f"{point}:{fault}"}
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "mileage: error: saving checkpoint iter_0000001 failed"
    )
    assert "previous checkpoint and the tracker are untouched" in lines[0]
    assert "Traceback" not in failed.stderr
    assert read_tracker(save).iteration == 0
    assert list_checkpoints(save) == before
    assert verify_save_dir(save)[1] == []
    resumed = cli(*train_args(tiny_hf, save, "--num-rollout", 3))
    assert resumed.returncode == 0, resumed.stderr
    assert "resume at rollout 1 of 3" in resumed.stdout and read_tracker(save).iteration == 2


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize(
    "point", ["save_after_model", "commit_before_rename", "commit_before_tracker"]
)
def test_kill_between_files_and_tracker_keeps_previous_checkpoint(
    cli, tiny_hf, tmp_path, after_one_rollout, point, async_save
):
    save = shutil.copytree(after_one_rollout, tmp_path / "run")
    extra = ["--async-save"] if async_save else []
    killed = cli(
        *train_args(tiny_hf, save, "--num-rollout", 3, *extra), env={"MILEAGE_KILL_AT": point}
    )
    assert killed.returncode == -9
    assert read_tracker(save).iteration == 0
    assert verify_save_dir(save)[1] == []
    leftovers = [p.name for p in save.iterdir() if p.name.startswith(STAGING_PREFIX)]
    resumed = cli(*train_args(tiny_hf, save, "--num-rollout", 3, *extra))
    assert resumed.returncode == 0, resumed.stderr
    assert "resume at rollout 1 of 3" in resumed.stdout
    for name in leftovers:
        assert f"removed leftover of an interrupted save: {name}" in resumed.stdout
    assert not [p for p in save.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert read_tracker(save).iteration == 2
