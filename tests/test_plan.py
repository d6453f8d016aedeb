"""Every row of the resume decision table (mileage/checkpoint/plan.py), via `mileage plan --json`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mileage.checkpoint.layout import TRACKER, architecture
from mileage.checkpoint.store import CheckpointState, commit_checkpoint, write_tracker
from mileage.cli.main import main
from mileage.models.hf import read_config_json


def plan(capsys, *args: str) -> tuple[int, dict | str]:
    """Run `mileage plan ... --json` in-process; (exit code, parsed plan or the error text)."""
    code = main(["plan", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err.strip())


def make_checkpoint(
    save_dir: Path, rollout_id, hf_dir: Path, config_override: dict | None = None
) -> Path:
    """A real, committed (tiny) checkpoint: enough for the planner, which never reads tensors."""
    config = {**architecture(read_config_json(hf_dir)), **(config_override or {})}
    state = CheckpointState(
        model={"w": torch.zeros(2)},
        optimizer=None if rollout_id == "release" else {"w.exp_avg": torch.zeros(2)},
        meta={
            "rollout_id": None if rollout_id == "release" else rollout_id,
            "model_config": config,
        },
    )
    return commit_checkpoint(save_dir, rollout_id, state)


@pytest.fixture
def base(tiny_hf, mileage_home):
    return ["--hf-checkpoint", tiny_hf, "--num-rollout", 10]


def test_no_load_is_a_fresh_start_from_hf(capsys, base, tiny_hf):
    code, p = plan(capsys, *base)
    assert code == 0
    assert p["action"] == "fresh" and p["start_rollout_id"] == 0
    assert (
        p["weights_from"] == str(tiny_hf) and p["weights_format"] == "hf" and p["iteration"] is None
    )
    assert not (p["load_optimizer"] or p["load_rng"] or p["load_data_state"])
    assert set(p) == {
        "action",
        "mode",
        "weights_from",
        "weights_format",
        "iteration",
        "start_rollout_id",
        "num_rollout",
        "load_optimizer",
        "load_rng",
        "load_data_state",
        "reasons",
        "precision",
        "precision_note",
        "micro_batch",
        "memory",
    }


def test_missing_load_dir_and_dir_without_tracker_are_fresh(capsys, base, tmp_path):
    code, p = plan(capsys, *base, "--load", tmp_path / "nope")
    assert code == 0 and p["action"] == "fresh" and "does not exist" in " ".join(p["reasons"])
    code, p = plan(capsys, *base, "--load", tmp_path)
    assert code == 0 and p["action"] == "fresh" and TRACKER in " ".join(p["reasons"])


def test_explicit_start_rollout_id_is_never_overwritten_on_fresh_start(capsys, base, tmp_path):
    code, p = plan(capsys, *base, "--load", tmp_path / "nope", "--start-rollout-id", 3)
    assert code == 0 and p["action"] == "fresh" and p["start_rollout_id"] == 3


def test_tracker_n_resumes_at_n_plus_1(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 0, tiny_hf)
    make_checkpoint(tmp_path, 1, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path, "--save", tmp_path)
    assert code == 0
    assert p["action"] == "resume" and p["start_rollout_id"] == 2 and p["iteration"] == 1
    assert p["weights_from"] == str(tmp_path / "iter_0000001") and p["weights_format"] == "native"
    assert p["load_optimizer"] and p["load_rng"] and p["load_data_state"]


def test_release_tracker_is_a_fresh_start_from_release_weights(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, "release", tiny_hf)
    assert (tmp_path / TRACKER).read_text().strip() == "release"
    code, p = plan(capsys, *base, "--load", tmp_path, "--save", tmp_path)
    assert code == 0
    assert p["action"] == "fresh" and p["start_rollout_id"] == 0 and p["iteration"] is None
    assert p["weights_from"] == str(tmp_path / "release") and p["weights_format"] == "native"
    assert not (p["load_optimizer"] or p["load_rng"] or p["load_data_state"])


@pytest.mark.parametrize("step", [0, 1])
def test_ckpt_step_loads_exactly_that_iteration(capsys, base, tmp_path, tiny_hf, step):
    for i in range(3):
        make_checkpoint(tmp_path, i, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path, "--save", tmp_path, "--ckpt-step", step)
    assert code == 0 and p["iteration"] == step and p["start_rollout_id"] == step + 1
    assert p["weights_from"] == str(tmp_path / f"iter_{step:07d}")


def test_ckpt_step_absent_or_incomplete_is_an_error(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 0, tiny_hf)
    code, err = plan(capsys, *base, "--load", tmp_path, "--ckpt-step", 5)
    assert code == 2 and "iter_0000005 does not exist" in err and "complete checkpoints" in err
    broken = make_checkpoint(tmp_path, 1, tiny_hf)
    (broken / "manifest.json").unlink()
    code, err = plan(capsys, *base, "--load", tmp_path, "--ckpt-step", 1)
    assert code == 2 and "incomplete" in err


def test_ckpt_step_never_applies_to_the_reference(tmp_path, tiny_hf):
    from mileage.checkpoint.plan import StartFlags, gather_disk_state, reference_source

    make_checkpoint(tmp_path, 0, tiny_hf)
    flags = StartFlags(str(tiny_hf), 10, load=str(tmp_path), ckpt_step=0)
    assert reference_source(flags, gather_disk_state(flags, None)) == (str(tiny_hf), "hf")


def test_finetune_takes_weights_only_and_starts_at_zero(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path / "a", 4, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path / "a", "--finetune", "--save", tmp_path / "b")
    assert code == 0 and p["action"] == "fresh" and p["start_rollout_id"] == 0
    assert p["weights_from"] == str(tmp_path / "a" / "iter_0000004") and p["iteration"] == 4
    assert not (p["load_optimizer"] or p["load_rng"] or p["load_data_state"])


def test_no_load_optim_and_no_load_rng_skip_only_that_part(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 2, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path, "--no-load-optim")
    assert code == 0 and p["action"] == "resume" and p["start_rollout_id"] == 3
    assert (p["load_optimizer"], p["load_rng"], p["load_data_state"]) == (False, True, True)
    code, p = plan(capsys, *base, "--load", tmp_path, "--no-load-rng")
    assert (p["load_optimizer"], p["load_rng"], p["load_data_state"]) == (True, False, True)


def test_explicit_start_on_resume_wins_with_a_warning(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 2, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path, "--start-rollout-id", 5)
    assert code == 0 and p["action"] == "resume" and p["start_rollout_id"] == 5
    assert any(r.startswith("warning:") and "3" in r for r in p["reasons"])
    code, p = plan(capsys, *base, "--load", tmp_path, "--start-rollout-id", 3)
    assert not any(r.startswith("warning:") for r in p["reasons"])


@pytest.mark.parametrize("content", ["", "\n", "latest", "-1", "3.5", "1 2"])
def test_invalid_tracker_is_refused_and_nothing_is_deleted(
    capsys, base, tmp_path, tiny_hf, content
):
    make_checkpoint(tmp_path, 0, tiny_hf)
    (tmp_path / TRACKER).write_text(content)
    before = sorted(os.listdir(tmp_path))
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2
    assert TRACKER in err and repr(content) in err and "complete checkpoints there: 0" in err
    assert sorted(os.listdir(tmp_path)) == before


def test_tracker_whitespace_is_fine(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 0, tiny_hf)
    (tmp_path / TRACKER).write_text("  0 \n\n")
    code, p = plan(capsys, *base, "--load", tmp_path)
    assert code == 0 and p["start_rollout_id"] == 1


def test_tracker_naming_missing_or_incomplete_dir_is_refused(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 0, tiny_hf)
    write_tracker(tmp_path, 7)
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2 and "iter_0000007 does not exist" in err and "complete checkpoints" in err
    make_checkpoint(tmp_path, 1, tiny_hf)
    (tmp_path / "iter_0000001" / "meta.json").unlink()
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2 and "iter_0000001" in err and "incomplete" in err


def test_start_equal_to_num_rollout_is_complete(capsys, base, tmp_path, tiny_hf, cli):
    make_checkpoint(tmp_path, 9, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path, "--save", tmp_path)
    assert code == 0 and p["action"] == "complete" and p["start_rollout_id"] == 10
    done = cli("train", *base, "--load", tmp_path, "--save", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "run already complete (10 of 10 rollouts)" in done.stdout
    assert "reference model" not in done.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_start_beyond_num_rollout_is_an_error(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 11, tiny_hf)
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2 and "start at rollout 12" in err and "--num-rollout is 10" in err


def test_model_config_mismatch_names_the_fields(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 0, tiny_hf, {"hidden_size": 64, "num_hidden_layers": 3})
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2 and "hidden_size: 64 -> 32" in err and "num_hidden_layers: 3 -> 2" in err


def test_save_with_foreign_checkpoints_is_refused(capsys, base, tmp_path, tiny_hf):
    save = tmp_path / "save"
    make_checkpoint(save, 0, tiny_hf)
    code, err = plan(capsys, *base, "--save", save)  # --load unset
    assert code == 2 and f"--load {save}" in err
    make_checkpoint(tmp_path / "other", 0, tiny_hf)
    code, err = plan(capsys, *base, "--save", save, "--load", tmp_path / "other")  # load elsewhere
    assert code == 2 and "already holds checkpoints" in err
    code, err = plan(
        capsys, *base, "--save", save, "--load", save, "--finetune"
    )  # finetune into it
    assert code == 2 and "already holds checkpoints" in err
    code, p = plan(capsys, *base, "--save", save, "--load", save)  # continuing it is fine
    assert code == 0 and p["action"] == "resume"


def test_mode_contradicting_the_directory_format_names_the_right_mode(
    capsys, base, tmp_path, tiny_hf
):
    make_checkpoint(tmp_path / "native", "release", tiny_hf)
    code, err = plan(capsys, *base, "--ref-load", tmp_path / "native")
    assert code == 2 and "--megatron-to-hf-mode raw" in err
    code, err = plan(capsys, *base, "--megatron-to-hf-mode", "raw", "--ref-load", tiny_hf)
    assert code == 2 and "--megatron-to-hf-mode bridge" in err
    code, p = plan(capsys, *base, "--megatron-to-hf-mode", "raw", "--ref-load", tmp_path / "native")
    assert code == 0 and p["weights_from"] == str(tmp_path / "native" / "release")
    assert p["action"] == "fresh" and p["start_rollout_id"] == 0 and not p["load_optimizer"]


def test_raw_mode_uses_ref_ckpt_step(capsys, base, tmp_path, tiny_hf):
    for i in range(2):
        make_checkpoint(tmp_path, i, tiny_hf)
    code, p = plan(
        capsys, *base, "--megatron-to-hf-mode", "raw", "--ref-load", tmp_path, "--ref-ckpt-step", 0
    )
    assert (
        code == 0
        and p["weights_from"] == str(tmp_path / "iter_0000000")
        and p["start_rollout_id"] == 0
    )
    assert not p["load_optimizer"]


def test_load_pointing_at_an_hf_directory_is_refused(capsys, base, tiny_hf):
    code, err = plan(capsys, *base, "--load", tiny_hf)
    assert code == 2 and "--hf-checkpoint" in err


def test_plan_reads_no_tensors(capsys, base, tmp_path, tiny_hf):
    """The planner must decide from listings alone: corrupt tensor files don't change the plan."""
    ckpt = make_checkpoint(tmp_path, 0, tiny_hf)
    for f in (ckpt / "model").iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(b"\0" * f.stat().st_size)
    code, p = plan(capsys, *base, "--load", tmp_path)
    assert code == 0 and p["action"] == "resume"
    shutil.rmtree(tmp_path)


def test_a_missing_tracker_resumes_from_the_newest_complete_checkpoint(
    capsys, base, tmp_path, tiny_hf
):
    """Tracker deleted, or a kill between rename and tracker: the newest complete iteration is
    found (an incomplete newer one is passed over) and the plan says so; nothing is rewritten."""
    save = tmp_path / "save"
    for rollout_id in (0, 1, 2):
        make_checkpoint(save, rollout_id, tiny_hf)
    (save / "iter_0000003").mkdir()  # an unfinished save: no manifest
    (save / TRACKER).unlink()
    code, p = plan(capsys, *base, "--save", save, "--load", save)
    assert code == 0 and p["action"] == "resume" and p["start_rollout_id"] == 3, p
    assert p["iteration"] == 2 and p["load_optimizer"] and p["load_data_state"]
    said = " ".join(p["reasons"])
    assert f"has no {TRACKER}: resuming from its newest complete checkpoint iter_0000002" in said


def test_untracked_complete_checkpoints_are_never_overwritten_by_a_fresh_start(
    capsys, base, tmp_path, tiny_hf
):
    save = tmp_path / "save"
    make_checkpoint(save, 0, tiny_hf)
    (save / TRACKER).unlink()
    code, err = plan(capsys, *base, "--save", save)
    assert code == 2 and "already holds checkpoints (0 complete)" in err, err
    assert f"pass --load {save}" in err


def test_a_resume_before_newer_checkpoints_says_it_writes_over_them(
    capsys, base, tmp_path, tiny_hf
):
    save = tmp_path / "save"
    for rollout_id in (0, 1, 2):
        make_checkpoint(save, rollout_id, tiny_hf)
    code, p = plan(capsys, *base, "--save", save, "--load", save, "--ckpt-step", 0)
    assert code == 0 and p["start_rollout_id"] == 1
    said = [r for r in p["reasons"] if r.startswith("warning:")]
    assert said and "newer checkpoints (1, 2)" in said[0] and "writes over" in said[0], p
    code, p = plan(capsys, *base, "--save", save, "--load", save)  # the tracker's: no warning
    assert not [r for r in p["reasons"] if "newer checkpoints" in r]


def test_a_resume_with_other_trajectory_settings_names_them(tmp_path):
    from mileage.checkpoint.layout import CheckpointInfo, DirState, parse_tracker
    from mileage.checkpoint.plan import DiskState, StartFlags, plan_start

    meta = {"settings": {"--seed": 1, "--n-samples-per-prompt": 4, "--lr": 1e-4}}
    info = CheckpointInfo(str(tmp_path / "iter_0000003"), True, "", meta)
    state = DirState(str(tmp_path), True, tracker=parse_tracker("3"), checkpoints={3: info})
    disk = DiskState(state, state, None, None, None)
    same = (("--seed", 1), ("--n-samples-per-prompt", 4), ("--lr", 1e-4))
    flags = StartFlags("hf", 10, load=str(tmp_path), save=str(tmp_path), settings=same)
    assert not [r for r in plan_start(flags, disk).reasons if "settings changed" in r]
    other = (("--seed", 2), ("--n-samples-per-prompt", 8), ("--lr", 1e-4))
    flags = StartFlags("hf", 10, load=str(tmp_path), save=str(tmp_path), settings=other)
    (said,) = [r for r in plan_start(flags, disk).reasons if "settings changed" in r]
    assert "--seed 1 -> 2; --n-samples-per-prompt 4 -> 8." in said, said


def test_plan_names_a_precision_change_and_only_then(tmp_path):
    """A resume in another precision proceeds and says so; checkpoints from before the record
    were written in fp32."""
    from mileage.checkpoint.layout import CheckpointInfo, DirState, parse_tracker
    from mileage.checkpoint.plan import RESUME, DiskState, StartFlags, plan_start

    for saved, meta in (("bf16", {"precision": "bf16"}), ("fp32", {})):
        info = CheckpointInfo(str(tmp_path / "iter_0000003"), True, "", meta)
        state = DirState(str(tmp_path), True, tracker=parse_tracker("3"), checkpoints={3: info})
        disk = DiskState(state, state, None, None, None)
        for now in ("fp32", "bf16"):
            flags = StartFlags("hf", 10, load=str(tmp_path), save=str(tmp_path), precision=now)
            plan = plan_start(flags, disk)
            assert plan.action == RESUME and plan.start_rollout_id == 4 and plan.precision == now
            said = [r for r in plan.reasons if r.startswith("precision changed")]
            assert bool(said) == (saved != now), plan.reasons
            if said:
                assert said[0].startswith(
                    f"precision changed: saved by a {saved} run, resuming in {now}."
                )
            assert f"  precision: {now}" in plan.describe()
