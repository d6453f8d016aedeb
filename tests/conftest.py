"""Shared fixtures: an isolated MILEAGE_HOME, a tiny random HF model, and a CLI runner.

The suite runs on every core with pytest-xdist (`-n auto --dist loadfile`, pyproject's addopts):
each file runs whole on one worker, so a file's module fixtures are built once. Each worker
is a pytest session of its own; what several files share (the built-in model, the crash
harness's reference runs) is built once for all workers by `built_once`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # two workers on two cores: torch's default of one thread per core in each would
        # oversubscribe them, and OpenMP then runs 10-40x slower, not 2x. Launches of
        # `mileage` pass --num-threads themselves; this covers the worker and its children's
        # OpenMP pools.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_finish(session) -> None:
    # what the test modules imported (torch, transformers: about a million objects) lives as
    # long as the worker; out of the collector's sight, its full collections stay short
    gc.freeze()


def _shared_root(tmp_path_factory) -> Path:
    """A directory all xdist workers of this run share (the session's own one without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> dict:
    """`build(directory)`'s JSON-able result, computed by the first worker that asks and read
    back by the others (which wait on a lock meanwhile). A build that raised is retried by the
    next worker that asks, so its error shows in that worker's test too."""
    root = _shared_root(tmp_path_factory)
    result = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return json.loads(result.read_text())
        directory = root / name
        if directory.exists():  # a build that failed before: start clean
            import shutil

            shutil.rmtree(directory)
        directory.mkdir()
        value = build(directory)
        result.write_text(json.dumps(value))
        return value


@pytest.fixture(scope="session")
def mileage_home(tmp_path_factory) -> Path:
    """One cache for the whole run (all workers), so the built-in model is built at most once."""
    home = Path(os.environ.get("MILEAGE_TEST_HOME") or _shared_root(tmp_path_factory) / "home")
    home.mkdir(parents=True, exist_ok=True)
    os.environ["MILEAGE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    """A small random-init Llama with the built-in char tokenizer, saved as an HF directory."""
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny_hf"))


def tiny_llama_dir(out: Path, alphabet: str | None = None) -> Path:
    """`out` holding a small random-init Llama (seed 0) with a char tokenizer over `alphabet`
    (default: the built-in tasks')."""
    from transformers import LlamaForCausalLM

    from mileage.models.tiny import build_char_tokenizer, tiny_llama_config
    from mileage.rollout.tasks import builtin_alphabet

    tok = build_char_tokenizer(alphabet or builtin_alphabet())
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


def torchrun_env() -> dict[str, str]:
    """The environment of a `torchrun` launch in tests: this checkout's code, one thread per
    rank, output unbuffered (what a rank printed before a kill is not lost)."""
    return {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


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
def builtin_model(mileage_home, tmp_path_factory) -> Path:
    """The built-in model's directory, built once per test session (cached in MILEAGE_HOME)."""
    from mileage.rollout.builtin_model import ensure_builtin_model

    def build(_directory: Path) -> dict:
        # built here rather than by a first launch: a process that builds the model ends with
        # another global RNG state, which its checkpoints record, than one that finds it cached
        with torch.random.fork_rng():
            return {"path": str(ensure_builtin_model("addition"))}

    return Path(built_once(tmp_path_factory, "builtin_model", build)["path"])


def _reference_run(tmp_path_factory, name: str, async_save: bool) -> tuple[Path, object]:
    from mileage.testing.crash import run_uninterrupted
    from mileage.testing.kills import Launch, crash_run_args

    def build(directory: Path) -> dict:
        launch = run_uninterrupted(crash_run_args(async_save=async_save), directory / "run")
        return dataclasses.asdict(launch)

    record = built_once(tmp_path_factory, name, build)
    record["stdout_times"] = [tuple(pair) for pair in record["stdout_times"]]
    return _shared_root(tmp_path_factory) / name / "run", Launch(**record)


def assert_learned(save: Path, start: Path) -> None:
    """A comparison of two runs proves something only if training changed the weights."""
    from mileage.testing.compare import learning_problems

    problems = learning_problems(save, start)
    assert problems == [], problems


@pytest.fixture(scope="session")
def crash_reference(builtin_model, tmp_path_factory):
    """An uninterrupted run of the crash harness's command (sync saves): (save dir, launch).
    Tests read it and never write into it (they copy it first)."""
    save, launch = _reference_run(tmp_path_factory, "crash_reference", async_save=False)
    assert_learned(save, builtin_model)
    return save, launch


@pytest.fixture(scope="session")
def crash_reference_async(builtin_model, tmp_path_factory) -> Path:
    """The same run with --async-save (its checkpoints must equal the sync run's)."""
    save, _ = _reference_run(tmp_path_factory, "crash_reference_async", async_save=True)
    assert_learned(save, builtin_model)
    return save
