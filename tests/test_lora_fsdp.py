"""LoRA under torchrun with FSDP2 (N=2): the PEFT-adapted policy is sharded like any model, the
KL reference is the sharded policy with its adapter off, and the checkpoint holds the adapter
alone (every rank's shards). The run also distills from a teacher of another architecture
(the tiny model, an HF directory), sharded like the reference. A run killed at commit points on
either rank resumes to the uninterrupted N=2 run's adapter and optimizer tensors."""

from __future__ import annotations

import pytest
from conftest import torchrun_env

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR, load_tensors
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

NPROC = 2
ARGS = [
    "--num-rollout", "3",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--lora-rank", "8",
    "--lora-alpha", "16",
    "--lora-dropout", "0.1",
    "--target-modules", "all-linear",
    "--use-kl-loss", "--kl-loss-coef", "0.05",
    "--lr", "2e-3",
]  # fmt: skip
CHAIN = [
    Kill.at("optimizer_step", rank=1),
    Kill.at("save_after_model", rank=1),
    Kill.at("commit_before_tracker", rank=0),
    Kill.at("optimizer_step", 2, rank=0),
]


@pytest.fixture(scope="module")
def args(tiny_hf) -> list[str]:
    return [*ARGS, "--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", str(tiny_hf)]


@pytest.fixture(scope="module")
def reference(args, builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("lora_fsdp_reference") / "run"
    done = run_uninterrupted(args, save, nproc=NPROC, env=torchrun_env(), timeout=600)
    assert "reference model: the base" in done.stdout and "(adapter disabled)" in done.stdout
    assert "teacher model: " in done.stdout and "teacher kl" in done.stdout, done.stdout
    return save


def test_n2_lora_checkpoint_holds_the_trained_adapter_only(reference):
    last = checkpoint_path(reference, read_tracker(reference).iteration)
    adapter = load_tensors(last / MODEL_DIR)
    assert adapter and all(".lora_" in name for name in adapter), sorted(adapter)[:3]
    assert any(
        n.endswith("lora_B.default.weight") and v.abs().sum() > 0 for n, v in adapter.items()
    )
    state = load_tensors(last / OPTIMIZER_DIR)
    assert state and all(".lora_" in name for name in state), sorted(state)[:3]


def test_n2_lora_kills_on_either_rank_resume_to_the_uninterrupted_tensors(
    args, reference, tmp_path
):
    save = tmp_path / "run"
    outcomes = run_with_kills(
        args, save, CHAIN, max_reruns=2, nproc=NPROC, env=torchrun_env(), timeout=600
    )
    table = outcome_table(outcomes)
    assert all(o.died and o.intact and o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table
