"""torchrun with a remote engine: `torchrun --nproc-per-node 2 -m mileage train --rollout-engine
sglang` through two `mileage serve` servers, weights synced through the disk (rank 0 writes them
from the shards). Rank 0 sends the requests and every rank gets the samples; no rank keeps a
full copy of the model for generation. The rollouts are multi-turn with a tool: rank 0 runs
them (the tool once per call) and every rank trains on the samples it shares.

It shows: the run learns and the servers follow every update (the trainer's recomputed
log-probs match the servers' to float rounding); rollout 0 draws the samples a single process
draws through the same servers (row seeds); a run killed on either rank, including after the
servers got weights no checkpoint holds, resumes to the uninterrupted run in every tensor; and
`--rollout-weight-sync broadcast` from the shards, in several buckets, equals the disk-synced
run bit for bit.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from conftest import assert_learned, torchrun_env

from mileage.metrics import TIMING_KEYS, read_metrics
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill
from mileage.testing.servers import SAME_HEAD_AS_TRAINER, start_servers

pytestmark = pytest.mark.slow

TOOLS = Path(__file__).with_name("multiturn_tools.py")

NPROC = 2
ARGS = [
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--rollout-engine", "sglang",
    "--rollout-timeout", "30",
    "--rollout-sync-timeout", "60",
]  # fmt: skip
# multi-turn with a tool: rank 0 runs the rollouts, tools included, and shares the samples
# (`distributed.remote.where_driven`); train-async's rank 0 threads did so before it
TOOL_ARGS = [
    "--generate-execute-tool-function-path", f"{TOOLS}:tool_counted",
    "--generate-tool-call-parser", "odd_digit",
    "--generate-max-turns", "2",
]  # fmt: skip


def args_for(urls: list[str], num_rollout: int, tools: bool = True) -> list[str]:
    return [
        *ARGS,
        *(TOOL_ARGS if tools else []),
        *[f for u in urls for f in ("--rollout-url", u)],
        "--num-rollout",
        str(num_rollout),
    ]


@pytest.fixture(scope="module")
def servers(builtin_model):
    started = start_servers(builtin_model, 2, args=SAME_HEAD_AS_TRAINER)
    yield [s.url for s in started]
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference(servers, builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("remote_n2") / "run"
    calls = save.parent / "tool_calls.log"
    env = {**torchrun_env(), "MILEAGE_TEST_TOOL_LOG": str(calls)}
    done = run_uninterrupted(args_for(servers, 2), save, nproc=NPROC, env=env, timeout=600)
    assert_learned(save, builtin_model)
    return save, done


def served_version(url: str) -> str:
    with urllib.request.urlopen(url + "/get_model_info", timeout=30) as reply:
        return json.loads(reply.read())["weight_version"]


def test_n2_through_servers_learns_and_the_servers_follow_the_weights(reference, servers):
    save, _ = reference
    records = read_metrics(save)
    assert [r["rollout_id"] for r in records] == [0, 1]
    # every rollout was generated with the weights the trainer had at the time
    assert all(0 <= r["logprob_abs_diff"] < 1e-4 for r in records), records
    assert {served_version(url) for url in servers} == {str(records[-1]["global_step"])}
    # the tool ran once per call the rollouts made: on rank 0, not once per rank
    ran = (save.parent / "tool_calls.log").read_text().splitlines()
    assert len(ran) == sum(r["rollout/tool_calls"] for r in records) > 0


def test_n2_draws_the_samples_of_one_process(reference, servers, tmp_path):
    single = tmp_path / "n1"
    run_uninterrupted(args_for(servers, 1), single, timeout=600)
    (one,) = read_metrics(single)
    first = read_metrics(reference[0])[0]
    for key in ("prompt_indices", "reward_mean", "accuracy", "response_len"):
        assert first[key] == one[key], key
    assert abs(first["logprob_abs_diff"] - one["logprob_abs_diff"]) < 1e-6


def test_n2_kills_resume_to_the_uninterrupted_run(reference, servers, tmp_path):
    save, _ = reference
    kills = [
        Kill.at("after_generate", rank=1),
        Kill.at("optimizer_step", rank=0),
        Kill.at("after_train", 2, rank=0),  # the servers hold rollout 1's weights, no checkpoint
        Kill.at("commit_before_tracker", rank=0),
    ]
    killed = tmp_path / "killed"
    outcomes = run_with_kills(args_for(servers[::-1], 2), killed, kills, max_reruns=2,
                              nproc=NPROC, env=torchrun_env(), timeout=600)  # fmt: skip
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(save, killed) == [], table
    strip = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(save)]
    again = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(killed)]
    assert strip == again


def test_n2_broadcast_from_the_shards_in_buckets_equals_the_disk_synced_run(
    reference, servers, builtin_model, tmp_path
):
    from mileage.models.hf import load_causal_lm

    save, disk = tmp_path / "broadcast", tmp_path / "weights"
    model_bytes = sum(t.numel() * 4 for t in load_causal_lm(builtin_model).state_dict().values())
    args = [*args_for(servers, 2), "--rollout-weight-sync", "broadcast",
            "--rollout-weights-dir", str(disk), "--update-weight-buffer-size", str(model_bytes // 3)]  # fmt: skip
    done = run_uninterrupted(args, save, nproc=NPROC, env=torchrun_env(), timeout=600)
    buckets = re.search(r"weights by broadcast in (\d+) bucket\(s\) .* gathered from the shards",
                        done.stdout)  # fmt: skip
    assert buckets and int(buckets.group(1)) >= 3, done.stdout
    assert not disk.exists() or not any(disk.iterdir())  # nothing went through the disk
    assert compare_runs(reference[0], save) == []
    strip = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(save)]
    disk_synced = [{k: v for k, v in r.items() if k not in TIMING_KEYS}
                   for r in read_metrics(reference[0])]  # fmt: skip
    assert strip == disk_synced


def test_n2_train_async_equals_one_process_and_resumes_bit_for_bit(
    servers, builtin_model, tmp_path
):
    """`torchrun --nproc-per-node 2 -m mileage train-async` through the servers: rank 0's
    threads generate slot N+1 while both ranks train N, and every rank gets the samples when
    the slot is collected. Slots 0 and 1 are generated with the starting weights, so the first
    two rollouts train on exactly the samples one process trains on, with one process's losses and
    gradient norms up to the summation order (test_distributed's tolerances); killed on
    either rank, including while slot 1 generates, the run resumes to the uninterrupted one
    bit for bit."""

    from mileage.checkpoint.layout import checkpoint_path
    from mileage.checkpoint.tensors import MODEL_DIR, load_tensors

    # fp32 training: the comparison with one process is then to the summation order alone.
    # --keep-old-actor: rollout 1's samples come from the starting weights, whose kept copy
    # (whole tensors, the same on both ranks) each rank swaps its shard of into the policy to
    # recompute their old log-probs; checkpointed by rank 0, restored on both after a kill
    keep = ["--keep-old-actor"]
    async_args = [*args_for(servers, 3, tools=False), "--precision", "fp32", *keep]
    reference = tmp_path / "n2"
    run_uninterrupted(
        async_args,
        reference,
        nproc=NPROC,
        env=torchrun_env(),
        timeout=600,
        subcommand="train-async",
    )
    assert_learned(reference, builtin_model)
    records = read_metrics(reference)
    assert [r["staleness_max"] for r in records] == [0, 1, 1]

    single = tmp_path / "n1"
    single_args = [*args_for(servers, 2, tools=False), "--precision", "fp32", *keep]
    run_uninterrupted(single_args, single, timeout=600, subcommand="train-async")
    for ours, theirs in zip(read_metrics(reference)[:2], read_metrics(single), strict=True):
        for key in ("prompt_indices", "reward_mean", "accuracy", "response_len"):
            assert ours[key] == theirs[key], key
        # the training on them: one process's up to the summation order, as test_distributed
        for key in ("grad_norm", "entropy", "ppo_kl", "logprob_abs_diff"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-9), key
    # and the weights, to test_distributed's fp32 tolerance (1e-6) but for a few elements: after
    # two AdamW steps an element whose gradient is near 0 has an update of about a fraction of lr
    # (1e-4) whatever the gradient's size, so the summation order's last bits can move it by
    # ~3e-6 (1 of 65536 in one tensor, measured); a wrongly averaged shard moves most by ~lr
    for rollout_id in (0, 1):
        mine = load_tensors(checkpoint_path(reference, rollout_id) / MODEL_DIR)
        one = load_tensors(checkpoint_path(single, rollout_id) / MODEL_DIR)
        assert mine.keys() == one.keys()
        for name, value in mine.items():
            apart = (value - one[name]).abs()
            assert apart.max() <= 1e-5 and (apart > 1e-6).float().mean() <= 1e-3, (
                rollout_id,
                name,
                apart.max().item(),
                int((apart > 1e-6).sum()),
            )

    kills = [
        Kill.at("async_generating", 2, rank=0),  # slot 1 generating on rank 0 while 0 trains
        Kill.at("commit_after_tracker", rank=0),  # iter_0 committed with slot 1 buffered
        Kill.at("optimizer_step", 3, rank=1),  # rollout 1 training on the buffered slot
    ]
    killed = tmp_path / "killed"
    outcomes = run_with_kills(async_args, killed, kills, max_reruns=2, nproc=NPROC,
                              env=torchrun_env(), timeout=600, subcommand="train-async")  # fmt: skip
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, killed) == [], table


def test_n2_broadcast_killed_between_buckets_on_either_rank_resumes_to_the_uninterrupted_run(
    reference, servers, builtin_model, tmp_path
):
    """Each kill leaves the servers holding the first bucket of new weights and the rest of the
    old (mid_weight_sync fires after bucket 0 of at least 3, on every rank), with their broadcast
    group's trainer end gone. The rerun forms a new group, sends every bucket again, and ends
    on the disk-synced run's tensors (which the broadcast run equals, see above)."""
    from mileage.models.hf import load_causal_lm

    model_bytes = sum(t.numel() * 4 for t in load_causal_lm(builtin_model).state_dict().values())
    args = [*args_for(servers, 2), "--rollout-weight-sync", "broadcast",
            "--update-weight-buffer-size", str(model_bytes // 3)]  # fmt: skip
    kills = [
        Kill.at("mid_weight_sync", rank=0),  # the first sync, before rollout 0
        Kill.at("mid_weight_sync", 2, rank=1),  # the sync after rollout 0's training
    ]
    killed = tmp_path / "killed"
    outcomes = run_with_kills(args, killed, kills, max_reruns=2, nproc=NPROC,
                              env=torchrun_env(), timeout=600)  # fmt: skip
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.intact and o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference[0], killed) == [], table


def test_n2_a_server_killed_mid_rollout_and_then_a_rank_resume_to_the_uninterrupted_run(
    reference, servers, builtin_model, tmp_path
):
    """A server is SIGKILLed while it generates rollout 0 (its second `/generate`): rank 0
    retries its groups on the other server, with the same row seeds, so the samples are the
    ones the healthy pair drew, and the next weight sync names the dead server as left out.
    Then rank 1 is killed in rollout 1's training, after the surviving server got weights no
    checkpoint holds, and the same command (still naming the dead server) runs again: it goes
    on with the live one and lands on the uninterrupted run in every tensor."""
    save, _ = reference
    # the fixture servers' LM head: whether the group it answers before dying is kept or retried
    # elsewhere depends on which of its two concurrent requests' threads runs first, so either
    # way that group's log-probs must be the reference run's
    (dying,) = start_servers(
        builtin_model, 1, env={"MILEAGE_SERVE_FAULT": "die:2"}, args=SAME_HEAD_AS_TRAINER
    )
    try:
        killed = tmp_path / "killed"
        kills = [Kill.at("after_train", 2, rank=1)]
        outcomes = run_with_kills(args_for([dying.url, servers[0]], 2), killed, kills,
                                  max_reruns=1, nproc=NPROC, env=torchrun_env(), timeout=600)  # fmt: skip
        table = outcome_table(outcomes)
        assert not dying.alive(), "the faulty server should have died in rollout 0"
        assert [o.status for o in outcomes] == ["killed"], table
        assert f"{dying.url} is left out of generation" in outcomes[0].launch.stdout, table
        assert all(o.resumed and not o.problems for o in outcomes), table
        assert compare_runs(save, killed) == [], table
    finally:
        dying.stop()
