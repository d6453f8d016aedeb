"""What metrics.jsonl, the progress line, the trackers and `mileage plot` call each quantity, and
the record of the evaluation before training (rollout_id -1) across kills and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import builtin_train_args

from mileage.metrics import EVAL_BEFORE_TRAINING, MetricsLog, read_metrics, rollout_records
from mileage.plot import draw_metrics, panel_curves
from mileage.progress import summary_line
from mileage.tracking import WandbTracker, offline_run_files, read_wandb_history, wandb_step

# ---------------------------------------------------------------- ppo_kl and kl


def _actor_stats(tiny_hf, with_reference: bool) -> tuple[dict, float]:
    """One rollout's statistics, and the drift from the sampling policy computed here."""
    from transformers import AutoModelForCausalLM

    from mileage.rollout.rollout import Sample
    from mileage.training.actor import Actor, AlgoConfig, sequence_logprobs
    from mileage.training.batch import pack_samples
    from mileage.training.optimizer import LRSchedule

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    # the reference is the starting weights, so its KL to the policy is 0 at the first step
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf).requires_grad_(False)
    lengths = [2, 3, 1, 2]
    samples = [
        Sample(None, [1, 5, 6], [7 + i] * n, [-1.5 - 0.25 * i] * n, "", float(i % 2), True)
        for i, n in enumerate(lengths)
    ]
    batch = pack_samples(samples, 0)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, 1.0)
    old = batch.old_logprobs[:, batch.target_offset :]
    mask = batch.loss_mask[:, batch.target_offset :]
    drift = float((((old - logp) * mask).sum(1) / mask.sum(1)).mean())
    algo = AlgoConfig(use_kl_loss=with_reference, kl_loss_coef=0.1 if with_reference else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    actor = Actor(
        model,
        opt,
        LRSchedule(0.0, 0, 0, "constant", 1),
        algo,
        1.0,
        2,
        0,
        reference if with_reference else None,
    )
    return actor.train_rollout(batch), drift


def test_without_a_reference_the_drift_is_ppo_kl_and_there_is_no_kl(tiny_hf):
    stats, drift = _actor_stats(tiny_hf, with_reference=False)
    assert "kl" not in stats
    assert drift != 0.0  # the engine's log-probs here are not the policy's
    assert stats["ppo_kl"] == pytest.approx(drift, rel=1e-5)


def test_with_a_reference_kl_is_the_kl_to_it_and_ppo_kl_the_drift(tiny_hf):
    stats, drift = _actor_stats(tiny_hf, with_reference=True)
    assert stats["kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy itself
    assert stats["ppo_kl"] == pytest.approx(drift, rel=1e-5)


ROLLOUT = {
    "rollout_id": 41,
    "reward_mean": 0.57,
    "accuracy": 0.57,
    "entropy": 0.512,
    "lr": 1e-4,
    "tokens_per_s": 3400.0,
    "step_time": 0.41,
}


def test_progress_line_names_the_drift_ppo_kl_and_shows_kl_only_with_a_reference():
    line = summary_line({**ROLLOUT, "ppo_kl": 1.2e-08})
    assert line == (
        "rollout 41 | reward 0.570 | solved 0.570 | ppo_kl +1.20e-08 | entropy 0.512 | "
        "lr 1.00e-04 | 3400 tok/s | 0.41s"
    )
    with_ref = summary_line({**ROLLOUT, "ppo_kl": 1.2e-08, "kl": 3.5e-03})
    assert "| ppo_kl +1.20e-08 | kl +3.50e-03 | entropy 0.512 |" in with_ref
    # a PPO critic-only rollout trains no policy: no drift, no KL, no entropy
    critic_only = {k: v for k, v in ROLLOUT.items() if k != "entropy"}
    assert "kl" not in summary_line({**critic_only, "value_loss": 0.25})


# ---------------------------------------------------------------- the evaluation before training


class _RecordingTracker:
    def __init__(self):
        self.caught_up: list[list[dict]] = []
        self.logged: list[dict] = []

    def catch_up(self, records: list[dict]) -> None:
        self.caught_up.append(records)

    def log(self, record: dict) -> None:
        self.logged.append(record)

    def close(self) -> None:
        pass


def test_cut_back_keeps_the_evaluation_before_training_unless_the_run_starts_over(tmp_path):
    tracker = _RecordingTracker()
    log = MetricsLog(tmp_path, [tracker])
    before = {"rollout_id": EVAL_BEFORE_TRAINING, "eval_accuracy": 0.25}
    for record in (before, *({"rollout_id": i, "reward_mean": i / 4} for i in range(4))):
        log.log(record)
    log.truncate_from(2)  # a resume from checkpoint 1
    assert [r["rollout_id"] for r in read_metrics(tmp_path)] == [-1, 0, 1]
    assert tracker.caught_up[-1] == read_metrics(tmp_path)
    assert rollout_records(read_metrics(tmp_path)) == read_metrics(tmp_path)[1:]
    log.truncate_from(0)  # a start at rollout 0 evaluates again: nothing is kept
    assert read_metrics(tmp_path) == [] and tracker.caught_up[-1] == []


class _FakeWandbRun:
    def __init__(self):
        self.points: list[tuple[int, dict]] = []

    def log(self, values: dict, step: int) -> None:
        self.points.append((step, values))


@pytest.mark.parametrize("held", [0, 1, 3])
def test_wandb_steps_start_at_0_with_the_evaluation_and_never_repeat(held):
    """W&B holds `held` steps already (a resumed process): only the rest is logged, in order."""
    tracker = WandbTracker.__new__(WandbTracker)
    tracker.run, tracker.next_step = _FakeWandbRun(), held
    records = [{"rollout_id": EVAL_BEFORE_TRAINING, "eval_accuracy": 0.25}] + [
        {"rollout_id": i, "reward_mean": 0.5} for i in range(3)
    ]
    tracker.catch_up(records[:2])
    for record in records[2:]:
        tracker.log(record)
    steps = [step for step, _ in tracker.run.points]
    assert steps == list(range(held, 4))
    assert all(values["rollout_id"] == step - 1 for step, values in tracker.run.points)
    if held == 0:
        assert tracker.run.points[0] == (0, {"eval_accuracy": 0.25, "rollout_id": -1})


def test_plot_starts_the_held_out_curve_at_the_evaluation_before_training():
    records = [
        {"rollout_id": -1, "eval_accuracy": 0.25},
        {"rollout_id": 0, "reward_mean": 0.5, "ppo_kl": 1e-8, "entropy": 1.0},
        {"rollout_id": 1, "reward_mean": 0.6, "ppo_kl": 2e-8, "kl": 0.01, "eval_accuracy": 0.5},
    ]
    assert panel_curves(records, ("eval_accuracy",)) == {"eval_accuracy": ([-1, 1], [0.25, 0.5])}
    fig = draw_metrics(records, "test")
    panels = {ax.get_title(): ax for ax in fig.axes}
    held_out = panels["held-out mean reward (greedy)"].lines
    assert [list(line.get_xdata()) for line in held_out] == [[-1, 1]]
    drift = panels["policy drift and KL"]
    assert [line.get_label() for line in drift.lines] == [
        "ppo_kl: drift from the sampling policy",
        "kl: KL to the reference model",
    ]
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.fixture
def offline_env(tmp_path) -> dict:
    # no network: an attempt to reach a server would fail on this address
    return {
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
    }


def test_evaluation_before_training_is_recorded_once_across_kills_everywhere(
    cli, builtin_model, tmp_path, offline_env
):
    """Killed after rollout 0 (no checkpoint yet: the rerun starts over and evaluates again),
    then after rollout 2 (checkpoint 1: the resume keeps the evaluation), then finished."""
    save, wandb_dir = tmp_path / "run", tmp_path / "wandb-files"
    args = builtin_train_args(
        *("--num-rollout", 4, "--eval-interval", 2, "--save-interval", 2),
        *("--save", save, "--load", save, "--use-tensorboard", "--use-wandb"),
        *("--wandb-mode", "offline", "--wandb-dir", wandb_dir, "--wandb-project", "mileage-test"),
    )
    for kill in ("after_metrics:1", "after_metrics:3"):
        killed = cli("train", *args, env={**offline_env, "MILEAGE_KILL_AT": kill})
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert "eval before training: reward" in killed.stdout
    resumed = cli("train", *args, env=offline_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "eval before training" not in resumed.stdout  # a resume does not evaluate again

    records = read_metrics(save)
    assert [r["rollout_id"] for r in records] == [-1, 0, 1, 2, 3]
    before = records[0]
    # the default held-out set is named after the built-in task; eval_accuracy is its mean reward
    assert {"rollout_id", "eval_accuracy", "eval/addition/pass@1"} <= set(before)
    assert before["eval_accuracy"] == before["eval/addition"] > 0
    assert [r["rollout_id"] for r in records if "eval_accuracy" in r] == [-1, 1, 3]

    # W&B: the run the checkpoint names (the second process's and the resumed one's)
    trainer = json.loads((save / "iter_0000003" / "trainer_state.json").read_text())
    files = offline_run_files(wandb_dir / "wandb", trainer["tracking"]["wandb_run_id"])
    assert len(files) == 2
    rows = [row for f in files for row in read_wandb_history(f)]
    assert [step for step, _ in rows] == [0, 1, 2, 3, 4]  # each once, in order
    assert [values["rollout_id"] for _, values in rows] == [-1, 0, 1, 2, 3]
    assert rows[0][1]["eval_accuracy"] == before["eval_accuracy"]
    assert [step for step, values in rows if "eval_accuracy" in values] == [
        wandb_step(r) for r in records if "eval_accuracy" in r
    ]

    # TensorBoard: each process hid what the previous one logged past its starting point
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval_accuracy")] == [
        (r["rollout_id"], pytest.approx(r["eval_accuracy"]))
        for r in records
        if "eval_accuracy" in r
    ]
    assert [e.step for e in events.Scalars("reward_mean")] == [0, 1, 2, 3]

    plotted = cli("plot", save)
    assert plotted.returncode == 0, plotted.stderr
    assert Path(save / "metrics.png").stat().st_size > 0
