"""`mileage train` with rollout on `mileage serve` servers through the SGLang client engine:
two servers, an exact resume after kills, and servers that die, hang or answer garbage."""

from __future__ import annotations

import pytest
from conftest import fast_train_args

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.store import verify_checkpoint
from mileage.metrics import read_metrics
from mileage.testing.compare import compare_runs
from mileage.testing.crash import Kill, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.servers import start_servers

# two optimizer steps per rollout, so a kill can land between them
TRAIN = ["--global-batch-size", "8", "--rollout-shuffle", "--lr", "1e-3"]


def engine_args(urls, *extra: str) -> list[str]:
    flags = ["--rollout-engine", "sglang", "--rollout-timeout", "8", "--rollout-sync-timeout", "8"]
    for url in urls:
        flags += ["--rollout-url", url]
    return [*flags, *extra]


def train_args(tiny_hf, urls, num_rollout: int, *extra: str) -> list[str]:
    return [
        *fast_train_args(tiny_hf, *TRAIN, *engine_args(urls, *extra)),
        "--num-rollout",
        str(num_rollout),
    ]


@pytest.fixture(scope="module")
def healthy(tiny_hf):
    servers = start_servers(tiny_hf, 2)
    yield [s.url for s in servers]
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def reference(healthy, tiny_hf, tmp_path_factory):
    """Two rollouts through two healthy servers, saved after each."""
    save = tmp_path_factory.mktemp("reference") / "run"
    run_uninterrupted(train_args(tiny_hf, healthy, 2), save)
    return save


def test_two_rollouts_on_two_servers(reference, cli, tiny_hf, healthy, tmp_path):
    records = read_metrics(reference)
    assert [r["rollout_id"] for r in records] == [0, 1]
    # the trainer recomputed the engine's log-probs: same arithmetic, so nearly equal
    assert all(0 <= r["logprob_abs_diff"] < 1e-4 for r in records)
    # the same run with one server gives the same tensors: samples do not depend on the server
    one = tmp_path / "one"
    done = cli("train", *train_args(tiny_hf, healthy[:1], 2), "--save", one, "--save-interval", 1)
    assert done.returncode == 0, done.stderr
    assert compare_runs(reference, one) == []


def test_tis_and_rollout_logprobs_change_the_update(cli, tiny_hf, healthy, tmp_path):
    runs = {}
    for name, extra in {"tis": ["--use-tis", "--tis-clip", "1.0", "--tis-clip-low", "1.0"],
                        "rollout": ["--use-rollout-logprobs"]}.items():  # fmt: skip
        done = cli("train", *train_args(tiny_hf, healthy, 1, *extra), "--save", tmp_path / name)
        assert done.returncode == 0, done.stderr
        runs[name] = read_metrics(tmp_path / name)[0]
    # clamped to exactly 1 the weights change nothing but are reported
    assert runs["tis"]["tis_mean"] == 1.0 and "tis_mean" not in runs["rollout"]
    bad = cli("train", *train_args(tiny_hf, healthy, 1, "--use-tis", "--use-rollout-logprobs"))
    assert bad.returncode == 2 and "--use-tis" in bad.stderr


def test_resume_through_mileage_serve_is_bit_exact(healthy, tiny_hf, tmp_path):
    args = train_args(tiny_hf, healthy, 3)
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference)
    kills = [
        Kill.at("rollout_start"),
        Kill.at("after_generate"),
        Kill.at("optimizer_step", 2),  # between the two optimizer steps of rollout 0
        Kill.at("save_after_model"),
        Kill.at("after_train", 2),  # after the new weights went to the servers
        Kill.at("commit_before_tracker"),
        Kill.at("after_metrics"),
    ]
    outcomes = run_with_kills(args, tmp_path / "killed", kills)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, tmp_path / "killed") == [], table


@pytest.mark.parametrize("fault", ["die:3", "hang:3", "garbage:3"])
def test_a_faulty_server_is_retried_on_the_other(fault, reference, tiny_hf, tmp_path, cli):
    # the third /generate request of the faulty server is in rollout 1
    faulty = start_servers(tiny_hf, 1, env={"MILEAGE_SERVE_FAULT": fault})
    good = start_servers(tiny_hf, 1)
    try:
        save = tmp_path / "run"
        urls = [faulty[0].url, good[0].url]
        done = cli("train", *train_args(tiny_hf, urls, 2), "--save", save, "--save-interval", 1)
        assert done.returncode == 0, done.stderr
        if fault.startswith("die"):
            assert not faulty[0].alive()
        assert compare_runs(reference, save) == []  # the retried groups drew the same samples
    finally:
        for s in faulty + good:
            s.stop()


def test_when_every_try_fails_the_run_stops_and_a_rerun_continues(
    reference, tiny_hf, tmp_path, cli
):
    save = tmp_path / "run"
    (dying,) = start_servers(tiny_hf, 1, env={"MILEAGE_SERVE_FAULT": "die:5"})  # rollout 1
    try:
        args = train_args(tiny_hf, [dying.url], 2, "--rollout-attempts", "2")
        failed = cli("train", *args, "--save", save, "--save-interval", 1)
    finally:
        dying.stop()
    assert failed.returncode == 2
    lines = failed.stderr.strip().splitlines()
    assert lines[-1].startswith("mileage: error: sglang rollout: /generate failed after 2 tries")
    assert "Traceback" not in failed.stderr
    assert read_tracker(save).iteration == 0
    assert verify_checkpoint(checkpoint_path(save, 0)) == []
    (fresh,) = start_servers(tiny_hf, 1)
    try:
        again = cli("train", *train_args(tiny_hf, [fresh.url], 2), "--save", save,
                    "--load", save, "--save-interval", 1)  # fmt: skip
    finally:
        fresh.stop()
    assert again.returncode == 0, again.stderr
    assert "resume at rollout 1" in again.stdout
    assert compare_runs(reference, save) == []


def test_engine_flags_are_checked(cli, tiny_hf):
    for args, message in [
        (["--rollout-engine", "sglang"], "needs --rollout-url"),
        (["--rollout-url", "http://127.0.0.1:1"], "needs --rollout-engine"),
        (["--rollout-engine", "sglang", "--rollout-url", "localhost:1"], "http://"),
    ]:
        done = cli("train", *fast_train_args(tiny_hf, *args))
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
