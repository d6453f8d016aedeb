"""A flipped byte in any part of a checkpoint refuses the resume in one line, before training.

Every restore goes through one verification of the whole iteration directory against its
manifest (`store.require_intact`, called by `components.build_run`), whatever kind of run reads
it. It once covered only full-model resumes: a LoRA resume loaded a damaged adapter and
trained on (one byte), or died in a torch unpickling traceback (four). One checkpoint holding
every part (a LoRA + PPO train-async run with --keep-old-actor: adapter, optimizer, critic,
RNG, kept old-actor weights, trainer state with its rollout buffer) and the crash harness's
full-model run are damaged one part per case, each in a copy of the single iteration resumed.
`mileage eval` reads weights too: it verifies them as a resume does, and evaluates an HF
directory exported from a checkpoint exactly as training evaluated that checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import builtin_train_args

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.cli.main import main
from mileage.testing.kills import crash_run_args

pytest.importorskip("peft")

EVERY_PART = builtin_train_args(
    "--num-rollout", "2",
    "--global-batch-size", "16",
    "--keep-old-actor",
    "--lora-rank", "4",
    "--target-modules", "all-linear",
    "--advantage-estimator", "ppo",
)  # fmt: skip


@pytest.fixture(scope="module")
def every_part(builtin_model, tmp_path_factory) -> Path:
    """iter_0 of a 2-rollout run whose checkpoint holds every part a run can restore."""
    save = tmp_path_factory.mktemp("every_part") / "run"
    argv = ["train-async", *EVERY_PART, "--save", str(save), "--save-interval", "1"]
    assert main(argv) == 0
    iteration = checkpoint_path(save, 0)
    for part in ("model", "optimizer", "critic/model", "old_actor.safetensors", "rng.safetensors"):
        assert (iteration / part).exists(), part
    assert '"rollout_buffer"' in (iteration / "trainer_state.json").read_text()
    return iteration


def flip_digit_after(path: Path, key: str) -> None:
    """Change the first digit after `key` in a JSON file: still valid JSON, other contents."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode())
    while not chr(data[at]).isdigit():
        at += 1
    data[at] ^= 1  # '0' <-> '1', '2' <-> '3', ...
    path.write_bytes(bytes(data))


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def damaged_copy(iteration: Path, save: Path, relative: str, key: str | None) -> None:
    """`save` holding only a tracked copy of `iteration`, one byte of `relative` changed."""
    save.mkdir()
    shutil.copytree(iteration, save / iteration.name)
    tracked = int(iteration.name.removeprefix("iter_"))
    (save / "latest_checkpointed_iteration.txt").write_text(f"{tracked}\n")
    target = save / iteration.name / relative
    if key is None:
        flip_middle_byte(target)
    else:
        flip_digit_after(target, key)


def assert_refused(argv: list[str], save: Path, iteration: str, part: str, capsys) -> None:
    def listing() -> list[str]:
        return sorted(p.name for p in save.iterdir() if p.name != ".mileage.lock")

    before = listing()
    code = main([*argv, "--save", str(save), "--load", str(save)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines[-5:]
    line = lines[0]
    assert line.startswith("mileage: error: checkpoint "), line
    assert f"{iteration} is corrupt" in line and "checksum mismatch" in line, line
    assert f"({part}" in line and line.endswith("choose another with --ckpt-step"), line
    # refused before training: nothing new in the save directory
    assert listing() == before and "metrics.jsonl" not in before


# (file in the iteration, JSON key whose value is changed or None for a binary flip, part named)
LORA_RUN_PARTS = {
    "adapter": ("model/__0_0.distcp", None, "LoRA adapter"),
    "optimizer": ("optimizer/__0_0.distcp", None, "optimizer state"),
    "critic": ("critic/model/__0_0.distcp", None, "PPO critic"),
    "critic optimizer": ("critic/optimizer/__0_0.distcp", None, "PPO critic"),
    "old actor": ("old_actor.safetensors", None, "kept old-actor weights"),
    "rng": ("rng.safetensors", None, "RNG state"),
    "buffer": ("trainer_state.json", '"rollout_buffer"', "trainer state (counters, data "
               "position, rollout buffer)"),
    "trainer state": ("trainer_state.json", '"actor"', "trainer state"),
}  # fmt: skip


@pytest.mark.parametrize("part", sorted(LORA_RUN_PARTS))
def test_a_flipped_byte_in_a_lora_ppo_async_checkpoint_is_refused(
    every_part, part, tmp_path, capsys
):
    relative, key, named = LORA_RUN_PARTS[part]
    save = tmp_path / "run"
    damaged_copy(every_part, save, relative, key)
    assert_refused(["train-async", *EVERY_PART], save, every_part.name, named, capsys)


FULL_RUN_PARTS = {
    "model": ("model/__0_0.distcp", None, "model weights"),
    "optimizer": ("optimizer/__0_0.distcp", None, "optimizer state"),
    "rng": ("rng.safetensors", None, "RNG state"),
    "trainer state": ("trainer_state.json", '"data"', "trainer state"),
}


@pytest.mark.parametrize("part", sorted(FULL_RUN_PARTS))
def test_a_flipped_byte_in_a_full_model_checkpoint_is_refused(
    crash_reference, part, tmp_path, capsys
):
    reference, _ = crash_reference
    iteration = checkpoint_path(reference, 0)
    relative, key, named = FULL_RUN_PARTS[part]
    save = tmp_path / "run"
    damaged_copy(iteration, save, relative, key)
    assert read_tracker(save).iteration == 0
    assert_refused(["train", *crash_run_args()], save, iteration.name, named, capsys)


def evaluated_record(save: Path) -> dict:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r["rollout_id"] >= 0 and "eval/addition" in r)


def test_mileage_eval_refuses_a_damaged_checkpoint_and_evaluates_an_exported_hf_dir(
    crash_reference, tmp_path, capsys
):
    reference, _ = crash_reference
    record = evaluated_record(reference)
    step = record["rollout_id"]
    iteration = checkpoint_path(reference, step)
    save = tmp_path / "run"
    damaged_copy(iteration, save, "model/__0_0.distcp", None)
    assert main(["eval", *crash_run_args(), "--load", str(save)]) == 2
    # eval logs where its config comes from (stderr), then the one error line
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("mileage: error: checkpoint "), line
    assert f"{iteration.name} is corrupt" in line and "(model weights)" in line, line

    # an HF directory (no --load; "needs --load RUN" before): --ckpt-step names whose seeds
    hf = tmp_path / "hf"
    assert (
        main(["export-hf", "--load", str(reference), "--ckpt-step", str(step), "--out", str(hf)])
        == 0
    )
    capsys.readouterr()
    argv = ["eval", *crash_run_args(), "--hf-checkpoint", str(hf), "--ckpt-step", str(step)]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rollout_id"] == step
    assert result["metrics"] == {k: v for k, v in record.items() if k.startswith("eval")}
