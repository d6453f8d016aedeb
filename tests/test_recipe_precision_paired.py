"""The bookkeeping of scripts/recipe_precision_paired.py: each arm's cost from its metrics and the
gain of auto over fp32."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import recipe_precision_paired as script  # noqa: E402


def write_metrics(run_dir: Path, steps: list[tuple[float, float, float]]) -> None:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"rollout_id": -1, "eval_accuracy": 0.1})]  # the evaluation before
    for i, (step, gen, train) in enumerate(steps):
        lines.append(json.dumps({"rollout_id": i, "step_time": step, "gen_time": gen,
                                 "train_time": train}))  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_timing_leaves_the_warm_up_rollout_out_of_the_medians(tmp_path: Path) -> None:
    # the first rollout (warm-up) is the slowest by far: counted, it would move every median
    write_metrics(tmp_path / "a", [(99.0, 90.0, 9.0), (3.0, 1.0, 2.0), (5.0, 2.0, 3.0),
                                   (4.0, 1.5, 2.5)])  # fmt: skip
    cost = script.timing(tmp_path / "a", wall=100.04, cpu=80.06)
    assert cost == {"wall_s": 100.0, "cpu_s": 80.1, "rollouts": 4, "step_s_median": 4.0,
                    "gen_s_median": 1.5, "train_s_median": 2.5}  # fmt: skip


def test_gains_are_fp32_cost_over_auto_cost() -> None:
    fp32 = {"wall_s": 300.0, "cpu_s": 290.0, "step_s_median": 15.0, "gen_s_median": 6.0,
            "train_s_median": 9.0}  # fmt: skip
    auto = {"wall_s": 200.0, "cpu_s": 145.0, "step_s_median": 10.0, "gen_s_median": 4.0,
            "train_s_median": 6.0}  # fmt: skip
    assert script.gains(fp32, auto) == {"wall_s": 1.5, "cpu_s": 2.0, "step_s_median": 1.5,
                                        "gen_s_median": 1.5, "train_s_median": 1.5}  # fmt: skip


def test_auto_resolves_by_the_cpu_flags(monkeypatch) -> None:
    from mileage import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda *_: {"avx2", "fma"})
    assert script.resolved_precision(["--precision", "auto"]) == "fp32"
    monkeypatch.setattr(precision, "cpu_flags", lambda *_: {"avx2", "avx512_bf16"})
    assert script.resolved_precision(["--precision", "auto"]) == "bf16"
    assert script.resolved_precision(["--precision", "fp32"]) == "fp32"
