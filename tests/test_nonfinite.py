"""A NaN at each point of a rollout (reward, loss, gradient, weight, the checkpoint about to be
committed) stops the run with exit 2 naming the rollout and the quantity; with
--save-keep-last 1 the last good checkpoint survives, stays the tracked one and verifies.

One saved rollout is shared; each case copies it and resumes into the poisoned rollout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import builtin_train_args, run_cli

from mileage.checkpoint.layout import read_tracker
from mileage.checkpoint.store import verify_checkpoint

REWARD_NAN = "def reward(args, sample, **kwargs):\n    return float('nan')\n"
LOSS_NAN = (
    "import torch\n"
    "def loss(args, batch, logprobs, reduce):\n"
    "    return reduce(logprobs) * float('nan'), {}\n"
)


@pytest.fixture(scope="module")
def saved_once(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("nonfinite") / "run"
    done = run_cli("train", *builtin_train_args("--num-rollout", "1", "--save", save))
    assert done.returncode == 0, done.stderr
    return save


def resume(saved: Path, tmp_path: Path, *extra: str, env: dict | None = None):
    save = tmp_path / "run"
    shutil.copytree(saved, save)
    flags = ["--load", save, "--save", save, "--num-rollout", "3", "--save-interval", "1"]
    flags += ["--save-keep-last", "1"]
    return save, run_cli("train", *builtin_train_args(*flags, *extra), env=env)


def assert_last_good_kept(save: Path) -> None:
    tracker = read_tracker(save)
    assert tracker.iteration == 0, tracker
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000000"]
    assert verify_checkpoint(save / "iter_0000000") == []


POINTS = {
    "gradient": ("nan_gradient", "the gradient is not finite"),
    "weight after the step": ("nan_weight", "the weights after optimizer step"),
    "checkpoint before commit": ("nan_before_commit", "weights is not finite"),
}


@pytest.mark.parametrize("case", POINTS)
def test_a_nan_injected_stops_before_anything_is_committed(saved_once, tmp_path, case):
    point, message = POINTS[case]
    save, done = resume(saved_once, tmp_path, env={"MILEAGE_FAIL_AT": f"{point}:NAN"})
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mileage: error: rollout 1: "), last
    assert message in last, last
    assert "Traceback" not in done.stderr
    assert_last_good_kept(save)


@pytest.mark.parametrize("hook", ["reward", "loss"])
def test_a_user_hook_that_gives_nan_stops_the_run_and_keeps_the_checkpoint(
    saved_once, tmp_path, hook
):
    user = tmp_path / "user.py"
    if hook == "reward":
        user.write_text(REWARD_NAN)
        extra = ("--custom-rm-path", f"{user}:reward")
    else:
        user.write_text(LOSS_NAN)
        extra = ("--loss-type", "custom_loss", "--custom-loss-function-path", f"{user}:loss")
    save, done = resume(saved_once, tmp_path, *extra)
    assert done.returncode == 2, done.stderr
    assert hook in done.stderr.strip().splitlines()[-1].lower(), done.stderr
    assert_last_good_kept(save)


def test_skipping_nonfinite_steps_is_counted_and_capped(saved_once, tmp_path):
    """miles' --no-check-for-nan-in-loss-and-grad: the poisoned step is skipped and counted;
    the run goes on and saves. With a cap of 0 the same step stops it."""
    env = {"MILEAGE_FAIL_AT": "nan_gradient:NAN"}
    save, done = resume(saved_once, tmp_path, "--no-check-for-nan-in-loss-and-grad", env=env)
    assert done.returncode == 0, done.stderr
    assert read_tracker(save).iteration == 2
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["rollout_id"]: r.get("nonfinite_skipped", 0) for r in records}
    assert skipped == {0: 0, 1: 1, 2: 0}, skipped

    capped = tmp_path / "capped"
    capped.mkdir()
    flags = ("--no-check-for-nan-in-loss-and-grad", "--max-nonfinite-skips", "0")
    save, done = resume(saved_once, capped, *flags, env=env)
    assert done.returncode == 2, done.stderr
    assert "--max-nonfinite-skips 0" in done.stderr
    assert_last_good_kept(save)


def test_the_check_names_the_first_bad_tensor_and_passes_overflowing_finite_ones():
    import torch

    from mileage.training.finite import first_nonfinite

    ones, nan = torch.ones(3), torch.tensor([1.0, float("nan")])
    half_inf = torch.tensor([float("-inf")], dtype=torch.float16)
    assert first_nonfinite([("ones", ones), ("nan", nan), ("inf", half_inf)]) == "nan"
    assert first_nonfinite([("ints", torch.tensor([1, 2])), ("inf", half_inf)]) == "inf"
    # finite elements whose squares overflow fp32: the norm is inf, the tensor is finite
    big = torch.full((4,), 3e19)
    assert first_nonfinite([("big", big), ("ones", ones), ("none", None)]) is None
    assert first_nonfinite([("big", big), ("nan", nan)]) == "nan"
    assert first_nonfinite([("empty", torch.empty(0))]) is None
