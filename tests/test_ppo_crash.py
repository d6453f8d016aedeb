"""PPO resumes exactly: SIGKILL a run with a critic at every point of the actor+critic commit and
in the loop, rerun it until done, and compare every actor AND critic tensor (model, optimizer),
the trainer state (critic counters included) and the metrics with an uninterrupted run.
"""

from __future__ import annotations

import pytest
from conftest import assert_learned

from mileage.checkpoint.layout import CRITIC_DIR, checkpoint_path
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import PPO_SAVE_POINTS, Kill, ppo_crash_run_args

NUM_ROLLOUT = 4

# Kills in the order the run reaches them (the hit counts restart with every launch):
# rollout 0 (critic only) dies after logging, then after its commit; rollout 1 (the first actor
# step, which needs the critic's restored counters) dies at every point of its commit in commit
# order, then commits; then kills inside rollouts 2 and 3.
CHAIN = (
    Kill.at("after_metrics"),
    Kill.at("commit_after_tracker"),
    *(Kill.at(point) for point in PPO_SAVE_POINTS if point != "save_after_prune"),
    Kill.at("save_after_prune"),
    Kill.at("optimizer_step", 2),
    Kill.at("after_train"),
    Kill.at("save_after_critic"),
)


@pytest.fixture(scope="module")
def ppo_reference(builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("ppo_reference") / "run"
    run_uninterrupted(ppo_crash_run_args(NUM_ROLLOUT), save)
    assert_learned(save, builtin_model)
    return save


@pytest.fixture(scope="module")
def ppo_chain(ppo_reference, tmp_path_factory):
    save = tmp_path_factory.mktemp("ppo_killed") / "run"
    outcomes = run_with_kills(ppo_crash_run_args(NUM_ROLLOUT), save, CHAIN)
    return save, outcomes


def test_ppo_chain_reaches_every_point_of_the_actor_critic_commit():
    points = {kill.point for kill in CHAIN}
    assert set(PPO_SAVE_POINTS) <= points and {"save_after_critic_model", "save_after_critic"} <= (
        points
    )


def test_every_ppo_kill_killed_mid_run_and_resumed_where_committed(ppo_chain):
    _, outcomes = ppo_chain
    table = outcome_table(outcomes)
    assert all(o.died and o.intact and o.resumed and not o.problems for o in outcomes), table
    # the critic-only rollout 0 was committed before the kills of rollout 1's commit
    assert [o.rollout for o in outcomes[2 : 2 + len(PPO_SAVE_POINTS) - 1]] == [1] * (
        len(PPO_SAVE_POINTS) - 1
    ), table


def test_killed_ppo_run_equals_the_uninterrupted_one_actor_and_critic(ppo_reference, ppo_chain):
    save, _ = ppo_chain
    assert compare_runs(ppo_reference, save) == []
    # the comparison covered the critic: every checkpoint of both runs holds one
    for root in (ppo_reference, save):
        for rollout_id in range(NUM_ROLLOUT):
            assert (checkpoint_path(root, rollout_id) / CRITIC_DIR / "model").is_dir()
