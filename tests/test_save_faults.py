"""Faults while saving: disk full, I/O error, permission denied and files deleted under the run,
injected at every gap of the commit order (store.py) with synchronous saves, and at one gap of
each outcome with background saves.

Each failing save must stop the run with one line and exit 1, leave the tracker on a complete,
verified checkpoint, and the same command rerun must end with exactly the tensors and metrics of
a run that never failed (the crash harness's reference run, which learns)."""

from __future__ import annotations

import pytest
from conftest import assert_learned

from mileage.checkpoint.inspect import verify_save_dir
from mileage.checkpoint.layout import STAGING_PREFIX, read_tracker
from mileage.testing.compare import compare_runs
from mileage.testing.crash import launch
from mileage.testing.kills import (
    COMMITTED_SAVE_POINTS,
    RENAMED_SAVE_POINTS,
    SAVE_POINTS,
    crash_run_args,
)

pytestmark = pytest.mark.slow

# the fault points whose path argument is the staging directory: DELETE removes it there
STAGING_POINTS = (
    "save_after_model",
    "save_after_optimizer",
    "save_after_state",
    "save_before_manifest",
    "commit_before_rename",
)
KINDS = ("ENOSPC", "EIO", "EACCES")
# Background saves run the same commit (store.py) in their writer thread; they fail at one point
# of each kind of outcome (staging deleted on the second save, an I/O error before the rename, a
# renamed but untracked checkpoint, a committed one), with every fault kind once, rather than at
# all ten again (CI time: 4 failing launches instead of 10)
ASYNC_SAVE_POINTS = (
    "save_after_optimizer",
    "commit_before_rename",
    "commit_before_tracker",
    "commit_after_tracker",
)


def fault_chain() -> list[tuple[str, str, int]]:
    """(point, fault, hit) for every save point. A hit of 2 lets the launch's first save commit
    before the second fails, so the run moves on and later faults meet later rollouts."""
    chain = []
    for number, point in enumerate(SAVE_POINTS):
        fault = "DELETE" if point in STAGING_POINTS and number % 2 else KINDS[number % len(KINDS)]
        chain.append((point, fault, 2 if number in (1, 3) else 1))
    return chain


def test_the_chain_covers_every_save_point_and_fault_kind():
    chain = fault_chain()
    assert [point for point, _, _ in chain] == list(SAVE_POINTS)
    assert {fault for _, fault, _ in chain} == {*KINDS, "DELETE"}
    background = [link for link in chain if link[0] in ASYNC_SAVE_POINTS]
    assert len(background) == len(ASYNC_SAVE_POINTS)
    assert {fault for _, fault, _ in background} == {*KINDS, "DELETE"}
    assert {hit for _, _, hit in background} == {1, 2}
    assert {point in COMMITTED_SAVE_POINTS for point, _, _ in background} == {True, False}
    assert any(point in RENAMED_SAVE_POINTS for point, _, _ in background)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_anywhere_in_the_commit_stops_cleanly_and_the_rerun_is_exact(
    builtin_model, crash_reference, crash_reference_async, tmp_path, async_save
):
    args = crash_run_args(async_save=async_save)
    save = tmp_path / "run"
    chain = fault_chain()
    if async_save:
        chain = [link for link in chain if link[0] in ASYNC_SAVE_POINTS]
    for point, fault, hit in chain:
        before = read_tracker(save).iteration
        failed = launch(args, save, env={"MILEAGE_FAIL_AT": f"{point}:{fault}:{hit}"})
        where = f"{point}:{fault}:{hit}"
        assert failed.returncode == 1, f"{where}: {failed.tail()}"
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in failed.stderr, f"{where}: {failed.stderr}"
        assert lines[0].startswith("mileage: error: saving checkpoint iter_"), where
        committed = point in COMMITTED_SAVE_POINTS
        expected = (-1 if before is None else before) + (hit - 1) + int(committed)
        assert read_tracker(save).iteration == (None if expected < 0 else expected), where
        if committed:
            assert "the tracker names it" in lines[0] or "it is committed" in lines[0], where
        else:
            assert "the previous checkpoint and the tracker are untouched" in lines[0], where
        assert verify_save_dir(save)[1] == [], where
        leftovers = [p.name for p in save.iterdir() if p.name.startswith((STAGING_PREFIX, "."))]
        assert leftovers == [".mileage.lock"], f"{where}: a failed save left {leftovers}"
    for _ in range(3):
        rerun = launch(args, save)
        if rerun.returncode == 0:
            break
    assert rerun.returncode == 0, rerun.tail()
    assert_learned(save, builtin_model)
    reference = crash_reference_async if async_save else crash_reference[0]
    assert compare_runs(reference, save) == []


@pytest.mark.parametrize("point", ["save_after_state", "commit_before_rename"])
def test_the_rerun_removes_and_names_what_a_killed_save_left(cli, tiny_hf, tmp_path, point):
    from conftest import fast_train_args

    save = tmp_path / "run"
    args = ["train", *fast_train_args(tiny_hf), "--num-rollout", 2, "--save-interval", 1,
            "--save", save, "--load", save]  # fmt: skip
    killed = cli(*args, env={"MILEAGE_KILL_AT": f"{point}:2"})
    assert killed.returncode == -9
    leftovers = [p.name for p in save.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert len(leftovers) == 1 and read_tracker(save).iteration == 0, leftovers
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"removed leftover of an interrupted save: {leftovers[0]}" in resumed.stdout
    assert not [p for p in save.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert read_tracker(save).iteration == 1 and verify_save_dir(save)[1] == []


def test_write_errors_inside_dcp_and_safetensors_surface_as_os_errors(tmp_path):
    """Both libraries wrap I/O failures in their own exception types; a save must still report
    them as the OSError that `commit_checkpoint` turns into one line."""
    import torch

    from mileage.checkpoint.tensors import save_safetensors, save_tensors

    occupied = tmp_path / "model"
    occupied.write_text("a file where the tensor directory should go")
    with pytest.raises(FileExistsError):
        save_tensors({"w": torch.zeros(3)}, occupied)
    with pytest.raises(OSError, match="writing rng.safetensors failed"):
        save_safetensors({"w": torch.zeros(3)}, tmp_path / "deleted" / "rng.safetensors")


def test_a_dcp_failure_that_is_no_os_error_is_one_line_with_the_room_left(tmp_path, monkeypatch):
    """A full disk under torch.save's zip writer is a RuntimeError, and DCP's exception text
    carries every rank's traceback: the save reports the first line of the cause and how much
    room the file system has, never the traceback."""
    import traceback

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from mileage.checkpoint.tensors import save_tensors

    def full_disk(*_args, **_kwargs):
        cause = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
                             "frame #0: c10::ThrowEnforceNotMet")  # fmt: skip
        raise CheckpointException("failed", {0: (cause, traceback.StackSummary())})

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(OSError) as caught:
        save_tensors({"w": torch.zeros(3)}, tmp_path / "model")
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert "writing model failed: RuntimeError: [enforce fail at inline_container.cc:672] . " \
           "unexpected pos 704 vs 598 (" in message  # fmt: skip
    assert message.endswith(f"MiB free on its file system): '{tmp_path / 'model'}'")
