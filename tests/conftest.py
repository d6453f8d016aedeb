"""Shared fixtures: an isolated MILEAGE_HOME, a tiny random HF model, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def mileage_home(tmp_path_factory) -> Path:
    """One cache per test session, so the built-in model is built at most once."""
    home = Path(os.environ.get("MILEAGE_TEST_HOME") or tmp_path_factory.mktemp("mileage_home"))
    os.environ["MILEAGE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    """A small random-init Llama with the built-in char tokenizer, saved as an HF directory."""
    from transformers import LlamaForCausalLM

    from mileage.models.tiny import build_char_tokenizer, tiny_llama_config
    from mileage.rollout.tasks import builtin_alphabet

    out = tmp_path_factory.mktemp("tiny_hf")
    tok = build_char_tokenizer(builtin_alphabet())
    config = tiny_llama_config(
        len(tok),
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
        hidden=32,
        layers=2,
        heads=2,
        intermediate=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python -m mileage ARGS` in a subprocess; returns the completed process (text mode)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mileage", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.fixture
def cli(mileage_home):
    return run_cli


def fast_train_args(hf_dir: Path, *extra: str) -> list[str]:
    """Flags for a seconds-long `mileage train` on the tiny random model."""
    return [
        "--hf-checkpoint",
        str(hf_dir),
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--eval-interval",
        "0",
        "--num-threads",
        "1",
        *extra,
    ]


def builtin_train_args(*extra: str) -> list[str]:
    """Flags for a seconds-long `mileage train` on the built-in model, which learns: its rewards
    vary within groups, so gradients are non-zero and runs that differ end with other weights."""
    return [
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--eval-interval",
        "0",
        "--num-threads",
        "1",
        *extra,
    ]


@pytest.fixture(scope="session")
def builtin_model(mileage_home) -> Path:
    """The built-in model's directory, built once per test session (cached in MILEAGE_HOME)."""
    from mileage.models.tiny import ensure_builtin_model

    # built here rather than by a first launch: a process that builds the model ends with
    # another global RNG state, which its checkpoints record, than one that finds it cached
    with torch.random.fork_rng():
        return ensure_builtin_model("addition")


def assert_learned(save: Path, start: Path) -> None:
    """A comparison of two runs proves something only if training changed the weights."""
    from mileage.testing.compare import learning_problems

    problems = learning_problems(save, start)
    assert problems == [], problems


@pytest.fixture(scope="session")
def crash_reference(builtin_model, tmp_path_factory):
    """An uninterrupted run of the crash harness's command (sync saves): (save dir, launch)."""
    from mileage.testing.crash import run_uninterrupted
    from mileage.testing.kills import crash_run_args

    save = tmp_path_factory.mktemp("reference") / "run"
    launch = run_uninterrupted(crash_run_args(), save)
    assert_learned(save, builtin_model)
    return save, launch


@pytest.fixture(scope="session")
def crash_reference_async(builtin_model, tmp_path_factory) -> Path:
    """The same run with --async-save (its checkpoints must equal the sync run's)."""
    from mileage.testing.crash import run_uninterrupted
    from mileage.testing.kills import crash_run_args

    save = tmp_path_factory.mktemp("reference_async") / "run"
    run_uninterrupted(crash_run_args(async_save=True), save)
    assert_learned(save, builtin_model)
    return save
