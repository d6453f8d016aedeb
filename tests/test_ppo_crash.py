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

# The commit's points around the critic's part: the actor's optimizer written and no critic, the
# critic's weights without its optimizer, the critic complete before the trainer state, the state
# complete before the tracker, and committed. The commit itself loops over the registry whatever
# the parts, so the points between the actor's own files are test_crash_anywhere's.
CRITIC_COMMIT_POINTS = (
    "save_after_optimizer",
    "save_after_critic_model",
    "save_after_critic",
    "save_after_state",
    "commit_before_tracker",
)

# Kills in the order the run reaches them (the hit counts restart with every launch):
# rollout 0 (critic only) dies after logging, then after its commit; rollout 1 (the first actor
# step, which needs the critic's restored counters) dies at each point above in commit order,
# then commits; then kills inside rollouts 2 and 3.
CHAIN = (
    Kill.at("after_metrics"),
    Kill.at("commit_after_tracker"),
    *(Kill.at(point) for point in CRITIC_COMMIT_POINTS),
    Kill.at("commit_after_tracker"),
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


def test_ppo_chain_kills_around_the_critic_s_part_of_the_commit():
    assert {"save_after_critic_model", "save_after_critic"} < set(PPO_SAVE_POINTS)
    assert [p for p in PPO_SAVE_POINTS if p in CRITIC_COMMIT_POINTS] == list(CRITIC_COMMIT_POINTS)
    # each neighbour of the critic's two points is killed at too
    at = PPO_SAVE_POINTS.index("save_after_critic_model")
    assert set(PPO_SAVE_POINTS[at - 1 : at + 3]) <= {kill.point for kill in CHAIN}


def test_every_ppo_kill_killed_mid_run_and_resumed_where_committed(ppo_chain):
    _, outcomes = ppo_chain
    table = outcome_table(outcomes)
    assert all(o.died and o.intact and o.resumed and not o.problems for o in outcomes), table
    # the critic-only rollout 0 was committed before the kills of rollout 1's commit
    rollout_1 = len(CRITIC_COMMIT_POINTS) + 1
    assert [o.rollout for o in outcomes[2 : 2 + rollout_1]] == [1] * rollout_1, table


def test_killed_ppo_run_equals_the_uninterrupted_one_actor_and_critic(ppo_reference, ppo_chain):
    save, _ = ppo_chain
    assert compare_runs(ppo_reference, save) == []
    # the comparison covered the critic: every checkpoint of both runs holds one
    for root in (ppo_reference, save):
        for rollout_id in range(NUM_ROLLOUT):
            assert (checkpoint_path(root, rollout_id) / CRITIC_DIR / "model").is_dir()
