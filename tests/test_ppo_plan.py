"""The critic's rows of the resume decision table (mileage/checkpoint/plan.py), via `mileage plan`.

A PPO checkpoint holds the critic in iter_N/critic/, committed with the actor; a start that
would pair an actor with a missing critic, a critic of another rollout or of another model
exits 2 with one line, before any model is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mileage.checkpoint.layout import architecture
from mileage.checkpoint.store import CheckpointState, commit_checkpoint
from mileage.cli.main import main
from mileage.models.hf import read_config_json

PPO = ("--advantage-estimator", "ppo")


def plan(capsys, *args) -> tuple[int, dict | str]:
    code = main(["plan", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err.strip())


def make_checkpoint(
    save_dir: Path,
    rollout_id: int,
    hf_dir: Path,
    critic: bool = True,
    critic_rollout: int | None = None,
    critic_config: dict | None = None,
) -> Path:
    """A committed (tiny) checkpoint, with a critic saved at `critic_rollout` (default: the
    actor's rollout) for a model config with `critic_config` changed."""
    config = architecture(read_config_json(hf_dir))
    critic_state = None
    if critic:
        critic_state = CheckpointState(
            model={"value_head.weight": torch.zeros(1, 2)},
            optimizer={"value_head.weight.exp_avg": torch.zeros(1, 2)},
            meta={
                "rollout_id": rollout_id if critic_rollout is None else critic_rollout,
                "model_config": {**config, **(critic_config or {})},
            },
        )
    state = CheckpointState(
        model={"w": torch.zeros(2)},
        optimizer={"w.exp_avg": torch.zeros(2)},
        meta={"rollout_id": rollout_id, "model_config": config},
        critic=critic_state,
    )
    return commit_checkpoint(save_dir, rollout_id, state)


@pytest.fixture
def base(tiny_hf, mileage_home):
    return ["--hf-checkpoint", tiny_hf, "--num-rollout", 10, *PPO]


def test_fresh_ppo_critic_starts_from_the_actor_weights(capsys, base, tiny_hf):
    code, p = plan(capsys, *base)
    assert code == 0 and p["action"] == "fresh"
    assert p["critic"] and p["critic_from"] is None and not p["critic_state"]
    assert main(["plan", *map(str, base)]) == 0
    assert "critic: the actor's starting weights + a fresh value head" in capsys.readouterr().out


def test_plans_without_ppo_have_no_critic_part(capsys, tiny_hf, mileage_home, tmp_path):
    make_checkpoint(tmp_path, 0, tiny_hf)
    code, p = plan(capsys, "--hf-checkpoint", tiny_hf, "--num-rollout", 10, "--load", tmp_path)
    assert code == 0 and p["action"] == "resume" and "critic" not in p


def test_ppo_resume_takes_the_critic_committed_with_the_actor(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 0, tiny_hf)
    make_checkpoint(tmp_path, 1, tiny_hf)
    code, p = plan(capsys, *base, "--load", tmp_path, "--save", tmp_path)
    assert code == 0 and p["action"] == "resume" and p["start_rollout_id"] == 2
    assert p["critic_from"] == str(tmp_path / "iter_0000001") and p["critic_state"]
    assert main(["plan", *map(str, base), "--load", str(tmp_path)]) == 0
    assert f"critic: {tmp_path / 'iter_0000001' / 'critic'} (weights, optimizer, counters)" in (
        capsys.readouterr().out
    )


def test_critic_missing_is_refused_unless_finetuning(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 3, tiny_hf, critic=False)
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2
    assert err == (
        f"mileage: error: {tmp_path / 'iter_0000003'} holds no critic (it was saved without "
        "--advantage-estimator ppo), so PPO cannot resume from it; pass --finetune to start a "
        "fresh critic from its weights, or another --load"
    )
    code, p = plan(capsys, *base, "--load", tmp_path, "--finetune")
    assert code == 0 and p["action"] == "fresh" and p["critic_from"] is None


def test_critic_behind_the_actor_is_refused(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 4, tiny_hf, critic_rollout=3)
    code, err = plan(capsys, *base, "--load", tmp_path)
    assert code == 2
    assert err == (
        f"mileage: error: {tmp_path / 'iter_0000004' / 'critic'} was saved at rollout 3 but the "
        "actor at 4: actor and critic are not one commit; refusing to pair them"
    )


def test_critic_of_another_model_is_refused(capsys, base, tmp_path, tiny_hf):
    make_checkpoint(tmp_path, 2, tiny_hf, critic_config={"hidden_size": 999})
    code, err = plan(capsys, *base, "--load", tmp_path)
    hidden = read_config_json(tiny_hf)["hidden_size"]
    assert code == 2 and err == (
        f"mileage: error: {tmp_path / 'iter_0000002' / 'critic'} is a critic of a different model "
        f"than --hf-checkpoint (hidden_size: 999 -> {hidden})"
    )
    # the same critic given as --critic-load to a fresh run
    code, err = plan(capsys, *base, "--critic-load", tmp_path)
    assert code == 2 and "is a critic of a different model than --hf-checkpoint" in err


def test_critic_load_gives_a_fresh_run_its_critic_weights(capsys, base, tmp_path, tiny_hf):
    other = tmp_path / "other_ppo_run"
    make_checkpoint(other, 5, tiny_hf)
    code, p = plan(capsys, *base, "--critic-load", other)
    assert code == 0 and p["action"] == "fresh"
    assert p["critic_from"] == str(other / "iter_0000005") and not p["critic_state"]
    # a resume pairs the actor with its own critic; --critic-load is named as ignored
    save = tmp_path / "save"
    make_checkpoint(save, 0, tiny_hf)
    code, p = plan(capsys, *base, "--critic-load", other, "--load", save)
    assert code == 0 and p["critic_from"] == str(save / "iter_0000000")
    assert any("--critic-load ignored" in r for r in p["reasons"])


def test_critic_load_must_hold_a_critic(capsys, base, tmp_path, tiny_hf):
    code, err = plan(capsys, *base, "--critic-load", tmp_path / "nope")
    assert code == 2 and err == f"mileage: error: --critic-load {tmp_path / 'nope'} does not exist"
    code, err = plan(capsys, *base, "--critic-load", tiny_hf)
    assert code == 2 and "has no latest_checkpointed_iteration.txt" in err
    make_checkpoint(tmp_path / "grpo", 1, tiny_hf, critic=False)
    code, err = plan(capsys, *base, "--critic-load", tmp_path / "grpo")
    assert code == 2 and "holds no critic/ (give the --save directory of a PPO run)" in err


def test_kl_coef_is_refused_with_ppo(capsys, base):
    code, err = plan(capsys, *base, "--kl-coef", "0.1")
    assert code == 2 and err == (
        "mileage: error: --kl-coef is refused with --advantage-estimator ppo (as in miles); "
        "use --use-kl-loss --kl-loss-coef"
    )


def test_plan_reads_no_critic_tensors(capsys, base, tmp_path, tiny_hf):
    """Corrupt critic tensor files do not change the plan (it decides from listings and JSON)."""
    ckpt = make_checkpoint(tmp_path, 0, tiny_hf)
    for f in (ckpt / "critic" / "model").iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(b"\0" * f.stat().st_size)
    code, p = plan(capsys, *base, "--load", tmp_path)
    assert code == 0 and p["critic_state"]
