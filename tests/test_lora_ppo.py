"""LoRA with PPO: the actor trains an adapter, the critic is a full model of its own (started
from the actor's starting weights), and the two commit atomically together: kills at every
point of the actor+critic commit resume to the uninterrupted run's tensors, adapter and critic.
"""

from __future__ import annotations

import pytest

from mileage.checkpoint.layout import CRITIC_DIR, checkpoint_path, read_tracker
from mileage.checkpoint.tensors import MODEL_DIR, load_tensors
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import CRITIC_SAVE_POINTS, Kill, ppo_crash_run_args

pytest.importorskip("peft")

NUM_ROLLOUT = 3
ARGS = [
    *ppo_crash_run_args(NUM_ROLLOUT),
    "--lora-rank", "8",
    "--lora-alpha", "16",
    "--target-modules", "all-linear",
    "--lr", "2e-3",
]  # fmt: skip
# rollout 0 trains the critic only; rollout 1 (the adapter's first step) dies at each point of
# the critic's part of the commit and at the tracker; rollout 2 inside its step
CHAIN = (
    Kill.at("commit_after_tracker"),
    *(Kill.at(point) for point in CRITIC_SAVE_POINTS),
    Kill.at("commit_before_tracker"),
    Kill.at("optimizer_step", 2),
)


@pytest.fixture(scope="module")
def reference(builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("lora_ppo_reference") / "run"
    run_uninterrupted(ARGS, save)
    return save


def test_lora_ppo_checkpoints_hold_the_adapter_and_a_full_critic(reference):
    last = checkpoint_path(reference, read_tracker(reference).iteration)
    actor = load_tensors(last / MODEL_DIR)
    critic = load_tensors(last / CRITIC_DIR / MODEL_DIR)
    assert actor and all(".lora_" in name for name in actor)
    assert any(n.endswith("lora_B.default.weight") and v.abs().sum() > 0 for n, v in actor.items())
    # the critic is a plain model (HF names, no adapter) with a value head, every weight trained
    assert not any(".lora_" in n or ".base_layer." in n for n in critic), sorted(critic)[:5]
    assert any("value_head" in n for n in critic)
    assert sum(v.numel() for v in critic.values()) > 5 * sum(v.numel() for v in actor.values())


def test_killed_lora_ppo_run_equals_the_uninterrupted_one(reference, tmp_path):
    save = tmp_path / "run"
    outcomes = run_with_kills(ARGS, save, CHAIN)
    table = outcome_table(outcomes)
    assert all(o.died and o.intact and o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table
