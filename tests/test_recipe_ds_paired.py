"""The bookkeeping of scripts/recipe_ds_paired.py: which checkpoint of the dynamic-sampling arm
counts, the group counts it reports and the paired bootstrap."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import recipe_ds_paired as script  # noqa: E402

COMMITS = [
    {"iteration": 0, "wall_s": 100.0, "cpu_s": 90.0},
    {"iteration": 1, "wall_s": 200.0, "cpu_s": 180.0},
    {"iteration": 2, "wall_s": 300.0, "cpu_s": 290.0},
    {"iteration": 3, "wall_s": 400.0, "cpu_s": 390.0},  # the rollout finished after SIGTERM
]


def test_judged_commit_the_wall_budget_binds() -> None:
    chosen, by_wall, by_cpu = script.judged_commit(COMMITS, wall=350.0, cpu=395.0)
    assert (chosen["iteration"], by_wall, by_cpu) == (2, 2, 3)


def test_judged_commit_the_cpu_budget_binds() -> None:
    chosen, by_wall, by_cpu = script.judged_commit(COMMITS, wall=399.0, cpu=250.0)
    assert (chosen["iteration"], by_wall, by_cpu) == (1, 2, 1)


def test_judged_commit_a_budget_on_the_commit_itself_counts() -> None:
    chosen, _, _ = script.judged_commit(COMMITS, wall=300.0, cpu=290.0)
    assert chosen["iteration"] == 2


def test_judged_commit_nothing_within_the_budget_stops() -> None:
    with pytest.raises(SystemExit, match="nothing within the budget"):
        script.judged_commit(COMMITS, wall=50.0, cpu=1000.0)


def write_samples(path: Path, rewards: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"samples": [{"reward": r} for r in rewards]}))


def test_group_counts_zero_variance_and_exact(tmp_path: Path) -> None:
    write_samples(tmp_path / "0.json", [0, 0, 0.5, 0, 0, 0])  # n=3: differ (late), equal
    write_samples(tmp_path / "1.json", [1.0, 1.0, 1.0, 0.2, 0.2, 0.2])  # both equal
    write_samples(tmp_path / "2.json", [0.3, 0, 0, 0, 0, 0])  # not counted: files=2
    counts = script.group_counts(tmp_path, 2, 3)
    assert counts == {
        "groups_sampled": 4,
        "groups_zero_variance": 3,
        "samples": 12,
        "samples_exact": 3,
    }


def test_ds_counts_sum_to_the_judged_rollout(tmp_path: Path) -> None:
    rows = [
        {"rollout_id": -1, "eval_accuracy": 0.1},
        {"rollout_id": 0, "dynamic_filter/groups_drawn": 16, "dynamic_filter/groups_kept": 9,
         "dynamic_filter/groups_dropped": 7, "dynamic_filter/drop_zero_std_0.0": 7,
         "dynamic_filter/groups_buffered": 1, "dynamic_filter/rounds": 2},
        {"rollout_id": 1, "dynamic_filter/groups_drawn": 8, "dynamic_filter/groups_kept": 6,
         "dynamic_filter/groups_dropped": 2, "dynamic_filter/drop_zero_std_0.0": 1,
         "dynamic_filter/drop_zero_std_1.0": 1, "dynamic_filter/groups_buffered": 0,
         "dynamic_filter/rounds": 1},
        {"rollout_id": 2, "dynamic_filter/groups_drawn": 40, "dynamic_filter/groups_kept": 8,
         "dynamic_filter/groups_dropped": 32, "dynamic_filter/drop_zero_std_0.0": 32,
         "dynamic_filter/rounds": 5},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = script.ds_counts(tmp_path, 1)
    assert counts == {
        "groups_drawn": 24,
        "groups_kept": 15,
        "groups_dropped": 9,
        "drop_zero_std_0.0": 8,
        "drop_zero_std_1.0": 1,
        "rounds": 3,
        "share_dropped": 0.375,
    }


def test_paired_difference_and_interval() -> None:
    before = [0.0] * 10
    after = [0.5] * 5 + [0.0] * 4 + [-0.1]
    out = script.paired(after, before)
    assert out["mean_difference"] == pytest.approx(0.24)
    assert out["items_better"] == 5 and out["items_worse"] == 1
    low, high = out["bootstrap_95"]
    assert -0.1 <= low < 0.24 < high <= 0.5
    assert script.paired(before, before)["bootstrap_95"] == [0.0, 0.0]
