"""PPO under torchrun: the critic is sharded like the actor, and actor and critic still commit
as one checkpoint, on 2 CPU ranks (gloo) with the built-in model.

One uninterrupted N=2 PPO run (rollout 0 trains the critic alone, rollouts 1-2 both) is the
reference; it must have learned, actor and critic, before anything is compared with it. Against
it:
- a crash chain at N=2 through every gap of the actor+critic commit on either rank, rerun with
  the same command: every actor and critic tensor (model and optimizer), the trainer state and
  the metrics `torch.equal` the reference's;
- its first checkpoint resumed at N=1 on the samples N=2 trained on: the critic's value loss and
  the actor's gradient norm equal N=2's up to the order of additions, and so do both models'
  weights (a critic that trained the whole batch on every rank, or averaged its gradients,
  would be off by a factor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_learned, torchrun_env

from mileage.checkpoint.layout import CRITIC_DIR, META, TRACKER, checkpoint_path, read_tracker
from mileage.checkpoint.store import verify_checkpoint
from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR, load_tensors
from mileage.metrics import read_metrics
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills, train_command
from mileage.testing.kills import Kill, Outcome

pytestmark = pytest.mark.slow

NPROC = 2
NUM_ROLLOUT = 3
ARGS = [
    "--num-rollout", str(NUM_ROLLOUT),
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--advantage-estimator", "ppo",
    "--normalize-advantages",
    "--lambd", "0.95",
    "--critic-lr", "3e-4",
    "--num-critic-only-steps", "1",
    # fp32 on every CPU (auto is bf16 where the CPU has it), so that N=1 against N=2 differs
    # only by the order of additions (~1e-7) and a factor-2 critic gradient cannot hide in it
    "--precision", "fp32",
]  # fmt: skip
ROLLOUTS = "rollouts/{rollout_id}.json"

# (kill, rollout it hits, tracker after it): the critic's shards are written by every rank
# (save_after_critic_model), its meta by rank 0 inside the commit (save_after_critic)
CHAIN = [
    (Kill.at("save_after_critic_model", rank=1), 0, None),
    (Kill.at("save_after_critic", rank=0), 0, None),
    (Kill.at("commit_after_tracker", rank=0), 0, 0),
    (Kill.at("optimizer_step", rank=1), 1, 0),  # the actor's first step (critic trained)
    (Kill.at("save_after_critic_model", rank=0), 1, 0),
    (Kill.at("save_after_critic", 2, rank=0), 2, 1),  # rollout 1 commits first
]


@pytest.fixture(scope="module")
def ppo_reference(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("dist_ppo_reference") / "run"
    samples = ["--save-debug-rollout-data", str(save.parent / ROLLOUTS)]
    done = run_uninterrupted([*ARGS, *samples], save, nproc=NPROC, env=torchrun_env(), timeout=300)
    assert_learned(save, builtin_model)
    # neither sharded forward (policy, critic) returns a view for FSDP2 to hook its backward on
    assert "returned a view tensor" not in done.stderr, done.stderr[-2000:]
    # the critic learned too: its weights moved from the first checkpoint's
    first = load_tensors(checkpoint_path(save, 0) / CRITIC_DIR / MODEL_DIR)
    last = load_tensors(checkpoint_path(save, NUM_ROLLOUT - 1) / CRITIC_DIR / MODEL_DIR)
    assert any(not torch.equal(first[k], last[k]) for k in first)
    return save


def test_n2_ppo_writes_every_ranks_critic_shards_into_the_one_commit(ppo_reference):
    for rollout_id in range(NUM_ROLLOUT):
        path = checkpoint_path(ppo_reference, rollout_id)
        assert verify_checkpoint(path) == []  # the manifest covers critic/ too
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            shards = sorted(p.name for p in (path / CRITIC_DIR / sub).glob("*.distcp"))
            assert shards == ["__0_0.distcp", "__1_0.distcp"], (rollout_id, sub)
        assert json.loads((path / CRITIC_DIR / META).read_text())["rollout_id"] == rollout_id
        assert json.loads((path / META).read_text())["world_size"] == NPROC
    records = read_metrics(ppo_reference)
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    assert [r["global_step"] for r in records] == [0, 2, 4]  # rollout 0: the critic alone
    assert all(r["value_loss"] > 0 for r in records)


@pytest.fixture(scope="module")
def ppo_chain(ppo_reference, tmp_path_factory) -> tuple[list[Outcome], list[str]]:
    save = tmp_path_factory.mktemp("dist_ppo_chain") / "run"

    def next_kill(outcomes: list[Outcome]) -> Kill | None:
        last = outcomes[-1] if outcomes else None
        if last is not None and not last.died and last.problems:
            return None
        return CHAIN[len(outcomes)][0] if len(outcomes) < len(CHAIN) else None

    outcomes = run_with_kills(
        ARGS, save, next_kill, max_reruns=2, nproc=NPROC, env=torchrun_env(), timeout=300
    )
    return outcomes, compare_runs(ppo_reference, save)


def test_n2_ppo_kills_resume_to_the_uninterrupted_actor_and_critic(ppo_chain):
    outcomes, diffs = ppo_chain
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    assert [(o.rollout, o.tracker) for o in outcomes] == [(r, t) for _, r, t in CHAIN], table
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.intact and outcome.resumed, table
    assert diffs == [], table  # actor and critic, model and optimizer, trainer state, metrics


def test_n2_ppo_checkpoint_resumes_at_n1_and_trains_like_n2_on_the_same_samples(
    ppo_reference, tmp_path
):
    save = tmp_path / "at_n1"
    shutil.copytree(ppo_reference, save)
    for rollout_id in range(1, NUM_ROLLOUT):
        shutil.rmtree(checkpoint_path(save, rollout_id))
    (save / TRACKER).write_text("0\n")
    replay = ["--load-debug-rollout-data", str(ppo_reference.parent / ROLLOUTS)]
    done = subprocess.run(
        train_command([*ARGS, *replay], save, 1),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size changed: saved by 2 process(es), resuming with 1" in done.stdout
    assert read_tracker(save).iteration == NUM_ROLLOUT - 1
    ours, theirs = read_metrics(save), read_metrics(ppo_reference)
    for mine, reference in zip(ours[1:], theirs[1:], strict=True):
        for key in ("prompt_indices", "lrs", "global_step", "reward_mean"):
            assert mine[key] == reference[key], key
        for key in ("value_loss", "value_clipfrac", "grad_norm", "ppo_kl"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-7), key
    last = NUM_ROLLOUT - 1
    for sub in (MODEL_DIR, f"{CRITIC_DIR}/{MODEL_DIR}"):
        mine = load_tensors(checkpoint_path(save, last) / sub)
        reference = load_tensors(checkpoint_path(ppo_reference, last) / sub)
        start = load_tensors(checkpoint_path(ppo_reference, 0) / sub)
        assert mine.keys() == reference.keys()
        # N=1 runs each prompt once for its samples (`mileage.training.shared_prompt`), N=2's
        # sharded actor does not: other sums, which AdamW's step (about lr whatever a
        # gradient's size) can carry to single elements; the updates since rollout 0 agree
        # (to 1.1e-4 of the largest here; a wrong shard would be off by its whole size)
        for name, value in mine.items():
            update = reference[name] - start[name]
            assert (value - reference[name]).norm() <= 1e-2 * update.norm() + 1e-7, name
