"""Debug rollout data: save every rollout's samples, replay them without any generation engine.

Runs on the built-in model, which learns (rewards vary within groups): a replay that got the
rewards or the behaviour log-probs wrong ends with other weights, so the comparison can fail.
"""

from __future__ import annotations

import json

from conftest import assert_learned, builtin_train_args

from mileage.checkpoint.inspect import list_checkpoints
from mileage.cli.main import main


def tracked_digests(save):
    row = [r for r in list_checkpoints(save) if r["tracked"]][0]
    return row["model_digest"], row["optimizer_digest"]


def test_replayed_run_reproduces_the_original_weights(
    cli, builtin_model, tmp_path, monkeypatch, capsys
):
    original, replay = tmp_path / "original", tmp_path / "replay"
    template = str(tmp_path / "rollouts" / "rollout_{rollout_id}.json")
    args = [*builtin_train_args("--rollout-shuffle"), "--num-rollout", 3]
    done = cli("train", *args, "--save", original, "--save-debug-rollout-data", template)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
        f"rollout_{i}.json" for i in range(3)
    ]
    assert_learned(original, builtin_model)
    saved = json.loads((tmp_path / "rollouts" / "rollout_0.json").read_text())["samples"]
    assert len({s["reward"] for s in saved}) > 1, "rewards must vary for the replay to matter"

    import mileage.build

    def no_engine(*a, **k):
        raise AssertionError("the generation engine must not be built when replaying")

    monkeypatch.setattr(mileage.build, "build_engine", no_engine)
    code = main(
        ["train", *map(str, args), "--save", str(replay), "--load-debug-rollout-data", template]
    )
    assert code == 0, capsys.readouterr().err
    assert tracked_digests(replay) == tracked_digests(original)


def test_replay_with_other_prompts_is_refused(cli, tiny_hf, tmp_path):
    from conftest import fast_train_args

    template = str(tmp_path / "r_{rollout_id}.json")
    args = [*fast_train_args(tiny_hf), "--num-rollout", 1]
    assert cli("train", *args, "--save-debug-rollout-data", template).returncode == 0
    bad = cli("train", *args, "--rollout-shuffle", "--load-debug-rollout-data", template)
    assert bad.returncode == 2 and "other prompts" in bad.stderr


def test_a_debug_template_may_name_the_seed_slot():
    """With dynamic sampling a file holds one sampling round: `{slot}` names it for what it is,
    `{rollout_id}` is the same number (a plain rollout's slot is its id)."""
    from mileage.rollout.rollout import debug_path

    assert debug_path("d/{slot}.json", 7) == debug_path("d/{rollout_id}.json", 7)
    assert str(debug_path("d/{slot}.json", 7)) == "d/7.json"
