"""Flags that change what a resume restores, checked through `mileage train` by their effects:
`--no-load-optim` starts Adam from zero moments, `--no-load-rng` leaves the global RNG as a
fresh process seeds it, and `--finetune` keeps only the weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import assert_learned, builtin_train_args, fast_train_args

from mileage.checkpoint.layout import checkpoint_path
from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR, load_tensors
from mileage.metrics import read_metrics

BETA1, BETA2 = 0.9, 0.98  # OptimConfig's defaults, which these runs use


def adam_state(save: Path, rollout_id: int) -> dict[str, dict[str, torch.Tensor]]:
    """{param: {"step", "exp_avg", "exp_avg_sq"}} of checkpoint `rollout_id`."""
    flat = load_tensors(checkpoint_path(save, rollout_id) / OPTIMIZER_DIR)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in flat.items():
        param, _, key = name.rpartition(".")
        state.setdefault(param, {})[key] = value
    return state


def moments_are_from_one_step(state: dict[str, dict[str, torch.Tensor]]) -> bool:
    """After one Adam step from zero moments, m = (1-b1) g and v = (1-b2) g^2 for every element,
    so v (1-b1)^2 = (1-b2) m^2. Moments carried over from earlier steps break this."""
    for moments in state.values():
        m, v = moments["exp_avg"].double(), moments["exp_avg_sq"].double()
        if not torch.allclose(v * (1 - BETA1) ** 2, (1 - BETA2) * m * m, rtol=1e-5, atol=1e-30):
            return False
    return True


def steps(state: dict[str, dict[str, torch.Tensor]]) -> set[int]:
    return {int(moments["step"]) for moments in state.values()}


@pytest.fixture(scope="module")
def two_rollouts(builtin_model, tmp_path_factory) -> Path:
    """A learning run of 2 rollouts, one optimizer step each, saved after each."""
    from conftest import run_cli

    save = tmp_path_factory.mktemp("base") / "run"
    done = run_cli("train", *builtin_train_args(), "--num-rollout", 2, "--save-interval", 1,
                   "--save", save, "--load", save)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_learned(save, builtin_model)
    assert steps(adam_state(save, 1)) == {2} and not moments_are_from_one_step(adam_state(save, 1))
    return save


def test_resume_restores_adam_moments_and_step(cli, two_rollouts, tmp_path):
    out = tmp_path / "resumed"
    done = cli("train", *builtin_train_args(), "--num-rollout", 3, "--load", two_rollouts,
               "--save", out)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resume at rollout 2 of 3" in done.stdout
    state = adam_state(out, 2)
    assert steps(state) == {3}
    assert not moments_are_from_one_step(state)


def test_no_load_optim_starts_adam_from_zero_moments_and_step_0(cli, two_rollouts, tmp_path):
    out = tmp_path / "no_optim"
    done = cli("train", *builtin_train_args(), "--num-rollout", 3, "--load", two_rollouts,
               "--save", out, "--no-load-optim")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resume at rollout 2 of 3" in done.stdout
    state = adam_state(out, 2)
    assert steps(state) == {1}, "Adam's step must restart from 0: one step taken since"
    assert moments_are_from_one_step(state)
    # the weights, data position and LR schedule are still resumed
    assert [r["rollout_id"] for r in read_metrics(out)] == [2]


def test_finetune_keeps_only_the_weights(cli, two_rollouts, builtin_model, tmp_path):
    tuned, fresh = tmp_path / "tuned", tmp_path / "fresh"
    args = ["train", *builtin_train_args(), "--num-rollout", 1]
    done = cli(*args, "--load", two_rollouts, "--finetune", "--save", tuned)
    assert done.returncode == 0, done.stderr
    assert "fresh start at rollout 0 of 1" in done.stdout
    assert cli(*args, "--save", fresh).returncode == 0
    tuned_log, fresh_log = read_metrics(tuned), read_metrics(fresh)
    # fresh data position and LR schedule, like a new run
    assert tuned_log[0]["prompt_indices"] == fresh_log[0]["prompt_indices"]
    assert tuned_log[0]["lrs"] == fresh_log[0]["lrs"]
    state = adam_state(tuned, 0)
    assert steps(state) == {1} and moments_are_from_one_step(state)
    # but the trained weights: its first rollout starts from the checkpoint, not the HF model
    base = load_tensors(checkpoint_path(two_rollouts, 1) / MODEL_DIR)
    assert tuned_log[0]["reward_mean"] != fresh_log[0]["reward_mean"] or any(
        not torch.equal(a, b)
        for a, b in zip(
            load_tensors(checkpoint_path(tuned, 0) / MODEL_DIR).values(),
            load_tensors(checkpoint_path(fresh, 0) / MODEL_DIR).values(),
            strict=True,
        )
    )
    assert base.keys() == load_tensors(checkpoint_path(tuned, 0) / MODEL_DIR).keys()


RNG_REWARD = """
import os, random, torch

def score(prompt, response, label):
    with open(os.environ["RNG_LOG"], "a") as log:
        log.write(f"{random.random()!r} {torch.rand(1).item()!r}\\n")
    return float(response.strip() == label.strip())
"""


def test_global_rng_is_restored_unless_no_load_rng(cli, tiny_hf, tmp_path):
    (tmp_path / "rng_reward.py").write_text(RNG_REWARD)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    args = ["train", *fast_train_args(tiny_hf), "--custom-rm-path", "rng_reward:score",
            "--num-rollout", 2, "--save-interval", 1]  # fmt: skip
    per_rollout = 4 * 4

    def draws(name: str, *extra) -> list[str]:
        log = tmp_path / f"{name}.log"
        save = tmp_path / name
        for _ in range(2 if "--debug-exit-after-rollout" in map(str, extra) else 1):
            done = cli(*args, "--save", save, "--load", save, *extra,
                       env={"RNG_LOG": str(log), "PYTHONPATH": path})  # fmt: skip
            assert done.returncode == 0, done.stderr
        return log.read_text().splitlines()

    straight = draws("straight")
    assert len(straight) == 2 * per_rollout and straight[:per_rollout] != straight[per_rollout:]
    resumed = draws("resumed", "--debug-exit-after-rollout", 1)
    assert resumed == straight, "a resume restores the global RNG: same draws as uninterrupted"

    # resume rollout 1 from the straight run's iter_0 without its RNG state
    unrestored = tmp_path / "unrestored.log"
    done = cli(*args, "--load", tmp_path / "straight", "--ckpt-step", 0, "--no-load-rng",
               "--save", tmp_path / "other", env={"RNG_LOG": str(unrestored), "PYTHONPATH": path})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resume at rollout 1 of 2" in done.stdout
    assert unrestored.read_text().splitlines() != straight[per_rollout:]
