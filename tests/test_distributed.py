"""torchrun + FSDP2 end to end, on 2 CPU ranks (gloo) with the built-in model, which learns.

Every launch costs a few seconds of imports per process, so the file shares launches: one
uninterrupted N=2 run of two rollouts (two optimizer steps each) is the reference, and it must
have learned before anything is compared with it. Against it:
- the crash chain at N=2: SIGKILL of rank 0 or rank 1 at 10 named points, rerun of the same
  torchrun command (so every resume after the first commit is a resume at N=2), every tensor
  `torch.equal`;
- a resume at N=1 of its first checkpoint that replays its second rollout's samples: position
  and LR continue exactly, and training on the same samples from the same weights gives the N=2
  gradients and weights up to reduction order (FSDP's sum is the single-process gradient);
- the other way: that checkpoint re-saved at N=1, resumed at N=2 on the same samples, ends
  bit for bit on the reference's second checkpoint;
- in process (no launch): a reload-and-resave at N=1 (the loaded tensors equal the saved ones
  bit for bit, `ckpt ls` digests do not depend on the world size), `ckpt verify` and `export-hf`
  of the N=2 checkpoint, the rollouts' samples against the prompts they are filed under.
SIGTERM and the lock take one launch each. Longer soaks: `scripts/soak.py --nproc 2`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_learned, torchrun_env
from safetensors.torch import load_file

from mileage.checkpoint.layout import META, TRACKER, checkpoint_path, read_tracker
from mileage.checkpoint.lock import SaveDirLock
from mileage.checkpoint.plan import RESUME, StartFlags, plan_start
from mileage.checkpoint.store import TRAINER_STATE, verify_checkpoint
from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR, RNG_FILE, load_tensors
from mileage.cli.main import main as mileage_main
from mileage.distributed import env
from mileage.distributed.checkpoint import gather_rng, rng_of_this_rank
from mileage.metrics import METRICS_FILE, read_metrics
from mileage.testing import resave
from mileage.testing.compare import compare_runs, compare_tensors
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills, train_command
from mileage.testing.kills import Kill, Outcome

NPROC = 2
NUM_ROLLOUT = 2
# the smallest run with two optimizer steps per rollout: 4 prompts x 4 samples (two groups per
# rank), global batch 8 (4 per rank); warmup then cosine LR, shuffled prompts
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
    "--log-probs-chunk-size", "3",  # the LM head a few tokens at a time under FSDP2, remainder too
    "--gradient-checkpointing",  # FSDP2's layers recomputed in the backward
    # packed micro-batches of about two samples: ranks whose shares pack into different counts
    # split theirs until every rank runs as many backwards (FSDP2 pairs them up)
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24",
]  # fmt: skip
ROLLOUTS = "rollouts/{rollout_id}.json"  # the reference's samples, under its parent directory

# (kill, rollout it hits, tracker after it). Points inside the commit after the shards are
# written run on rank 0 only; the others are aimed at either rank. A surviving rank runs on
# until its next collective, so a kill of rank 1 is aimed where that cannot log a rollout.
CHAIN = [
    (Kill.at("rollout_start", rank=1), 0, None),
    (Kill.at("optimizer_step", rank=1), 0, None),
    (Kill.at("save_after_model", rank=1), 0, None),  # rank 1's shards written, rank 0's maybe
    (Kill.at("commit_before_rename", rank=0), 0, None),
    (Kill.at("commit_after_tracker", rank=0), 0, 0),
    # rank 0 itself: killed on rank 1 here, rank 0 may log rollout 1 before it notices
    (Kill.at("after_train", rank=0), 1, 0),
    (Kill.at("after_metrics", rank=0), 1, 0),  # logged, not saved: the log is cut back
    (Kill.at("commit_before_tracker", rank=0), 1, 0),  # complete iter_1 the tracker misses
    (Kill.at("optimizer_step", 2, rank=0), 1, 0),  # the second step of rollout 1
    (Kill.at("save_after_model", rank=0), 1, 0),
]

pytestmark = pytest.mark.slow


def run_train(args: list[str], save: Path, nproc: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(args, save, nproc),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
    )


def cli(capsys, *args: object) -> tuple[int, str, str]:
    """`mileage ARGS` in this process (the checkpoint commands need no launch of their own)."""
    capsys.readouterr()
    code = mileage_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@contextmanager
def global_state_kept() -> Iterator[None]:
    """Undo what an in-process run sets globally (RNG states, threads, determinism)."""
    python_rng = random.getstate()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        with torch.random.fork_rng():
            yield
    finally:
        random.setstate(python_rng)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


@pytest.fixture(scope="module")
def reference(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("dist_reference") / "run"
    samples = ["--save-debug-rollout-data", str(save.parent / ROLLOUTS)]
    done = run_uninterrupted([*ARGS, *samples], save, nproc=NPROC, env=torchrun_env(), timeout=300)
    # every comparison with this run is vacuous unless it changed the weights
    assert_learned(save, builtin_model)
    # the sharded forward returns no view, on which FSDP2's backward hook would hang by a thread
    assert "returned a view tensor" not in done.stderr, done.stderr[-2000:]
    return save


# ---------------------------------------------------------------- N=2 training and checkpoints


def test_n2_run_writes_every_ranks_shards_and_commits_once(reference):
    for rollout_id in range(NUM_ROLLOUT):
        path = checkpoint_path(reference, rollout_id)
        assert verify_checkpoint(path) == []
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            assert sorted(p.name for p in (path / sub).glob("*.distcp")) == [
                "__0_0.distcp",
                "__1_0.distcp",
            ]
        assert json.loads((path / META).read_text())["world_size"] == NPROC
        assert set(load_file(str(path / RNG_FILE))) == {"torch_cpu", "rank1.torch_cpu"}
    assert read_tracker(reference).iteration == NUM_ROLLOUT - 1
    records = read_metrics(reference)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert [r["global_step"] for r in records] == [2, 4]
    assert not [p for p in reference.iterdir() if p.name.startswith(".staging")]


def test_n2_samples_answer_the_prompts_of_their_group_and_cover_every_group(
    reference, builtin_model
):
    """Each rank samples its share of the groups; the gathered rollout holds every group once,
    each sample generated from the prompt it is filed under."""
    from mileage.models.hf import load_tokenizer

    tokenizer = load_tokenizer(builtin_model)
    for record in read_metrics(reference):
        rollout = reference.parent / ROLLOUTS.format(rollout_id=record["rollout_id"])
        samples = json.loads(rollout.read_text())["samples"]
        expected = [i for i in record["prompt_indices"] for _ in range(4)]
        assert [s["prompt"]["index"] for s in samples] == expected
        for sample in samples:
            asked = tokenizer(sample["prompt"]["text"])["input_ids"]
            assert sample["prompt_ids"] == asked, sample["prompt"]


def test_n2_checkpoint_reloads_at_n1_bit_for_bit_with_equal_digests(reference, tmp_path, capsys):
    copy = tmp_path / "resaved_at_1"
    flags = [*ARGS, "--load", str(reference), "--save", str(copy), "--ckpt-step", "0"]
    with global_state_kept():
        assert resave.main(flags) == 0
    original, again = checkpoint_path(reference, 0), checkpoint_path(copy, 0)
    for sub in (MODEL_DIR, OPTIMIZER_DIR):
        tensors = load_tensors(original / sub)
        assert len(tensors) > 10
        assert compare_tensors(sub, tensors, load_tensors(again / sub)) == []
    assert json.loads((again / TRAINER_STATE).read_text()) == json.loads(
        (original / TRAINER_STATE).read_text()
    )
    assert json.loads((again / META).read_text())["world_size"] == 1
    digests = []
    for save in (reference, copy):
        code, out, err = cli(capsys, "ckpt", "ls", save, "--json")
        assert code == 0, err
        row = {r["rollout_id"]: r for r in json.loads(out)}[0]
        digests.append((row["model_digest"], row["optimizer_digest"]))
    assert digests[0] == digests[1]
    assert None not in digests[0]


def test_n2_checkpoint_resumes_at_n1_exactly_and_trains_like_n2_on_the_same_samples(
    reference, builtin_model, tmp_path
):
    """Resume rollout 1 at N=1 from the N=2 checkpoint of rollout 0, replaying the samples N=2
    trained on: position and LR continue exactly; the gradient and the weights are N=2's up to
    the order of floating-point additions (an averaged or overlapping shard would be off by a
    factor or a half batch)."""
    save = tmp_path / "at_n1"
    shutil.copytree(reference, save)
    shutil.rmtree(checkpoint_path(save, 1))
    (save / TRACKER).write_text("0\n")
    replay = ["--load-debug-rollout-data", str(reference.parent / ROLLOUTS)]
    done = run_train([*ARGS, *replay], save)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size changed: saved by 2 process(es), resuming with 1" in done.stdout
    assert_learned(save, builtin_model)
    ours, theirs = read_metrics(save), read_metrics(reference)
    assert [r["rollout_id"] for r in ours] == [0, 1]
    for key in ("prompt_indices", "lrs", "global_step", "reward_mean", "response_len"):
        assert ours[1][key] == theirs[1][key], key
    ours_ckpt, theirs_ckpt = checkpoint_path(save, 1), checkpoint_path(reference, 1)
    precision = json.loads((theirs_ckpt / META).read_text())["precision"]
    # N=1 runs each prompt once for its samples (`mileage.training.shared_prompt`) and N=2's
    # sharded model does not: other matmul shapes, so in bf16 other roundings (grad norm 1.3e-3
    # apart, ppo_kl, near 0, 9e-5), still far below a factor or a half batch
    rel, kl_abs = (1e-4, 1e-6) if precision == "fp32" else (1e-2, 5e-4)
    for key in ("grad_norm", "entropy", "ratio"):
        assert ours[1][key] == pytest.approx(theirs[1][key], rel=rel), key
    assert ours[1]["ppo_kl"] == pytest.approx(theirs[1]["ppo_kl"], rel=rel, abs=kl_abs)
    assert json.loads((ours_ckpt / META).read_text())["world_size"] == 1
    mine, reference_weights = (
        load_tensors(ours_ckpt / MODEL_DIR),
        load_tensors(theirs_ckpt / MODEL_DIR),
    )
    assert mine.keys() == reference_weights.keys()
    # this rollout moves weights by up to ~1e-4; another summation order, by ~1e-8 in fp32. In
    # bf16 (`--precision auto` on a CPU with AVX512-BF16 or AMX) other matmul shapes (the shared
    # prompt pass at N=1) also flip bf16 roundings, and AdamW's step, about lr whatever the
    # gradient's size, turns that into single elements up to 5.5e-5 apart: there the updates
    # are compared as wholes, still far closer than a wrongly averaged or overlapping shard's
    # (1.1 % of the largest tensor's update here)
    start = load_tensors(checkpoint_path(reference, 0) / MODEL_DIR)
    for name, value in mine.items():
        if precision == "fp32":
            torch.testing.assert_close(value, reference_weights[name], rtol=0, atol=1e-6)
        else:
            update = reference_weights[name] - start[name]
            assert (value - reference_weights[name]).norm() <= 0.05 * update.norm(), name


def test_n1_checkpoint_resumes_at_n2_and_lands_on_the_n2_run_bit_for_bit(
    reference, builtin_model, tmp_path
):
    """The other way round: rollout 0 of the N=2 run, re-saved by one process (its tensors equal
    bit for bit), resumes at N=2 on rollout 1's samples. Same weights, same optimizer state,
    same samples and the same N=2 arithmetic: rollout 1 must equal the N=2 run's, torch.equal."""
    save = tmp_path / "from_n1"
    flags = [*ARGS, "--load", str(reference), "--save", str(save), "--ckpt-step", "0"]
    with global_state_kept():
        assert resave.main(flags) == 0
    assert json.loads((checkpoint_path(save, 0) / META).read_text())["world_size"] == 1
    replay = ["--load-debug-rollout-data", str(reference.parent / ROLLOUTS)]
    done = run_train([*ARGS, *replay], save, nproc=NPROC)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size changed: saved by 1 process(es), resuming with 2" in done.stdout
    assert_learned(save, builtin_model)
    ours, theirs = read_metrics(save)[-1], read_metrics(reference)[1]
    assert ours["rollout_id"] == 1
    for key in ("prompt_indices", "lrs", "global_step", "grad_norm", "reward_mean"):
        assert ours[key] == theirs[key], key
    mine, reference_ckpt = checkpoint_path(save, 1), checkpoint_path(reference, 1)
    assert json.loads((mine / META).read_text())["world_size"] == NPROC
    for sub in (MODEL_DIR, OPTIMIZER_DIR):
        theirs_tensors = load_tensors(reference_ckpt / sub)
        assert compare_tensors(sub, load_tensors(mine / sub), theirs_tensors) == []
    assert json.loads((mine / TRAINER_STATE).read_text()) == json.loads(
        (reference_ckpt / TRAINER_STATE).read_text()
    )


def test_n2_checkpoint_verifies_exports_and_a_damaged_rank_shard_is_named(
    reference, builtin_model, tmp_path, capsys
):
    code, out, err = cli(capsys, "ckpt", "verify", reference)
    assert code == 0, err
    assert f"ok: {NUM_ROLLOUT} checkpoint(s) verified" in out

    out_dir = tmp_path / "hf"
    code, _, err = cli(
        capsys, "export-hf", "--load", reference, "--hf-checkpoint", builtin_model, "--out", out_dir
    )
    assert code == 0, err
    exported = {}
    for file in out_dir.glob("*.safetensors"):
        exported.update(load_file(str(file)))
    saved = load_tensors(checkpoint_path(reference, NUM_ROLLOUT - 1) / MODEL_DIR)
    assert exported.keys() >= saved.keys()
    assert compare_tensors("export", saved, {k: exported[k] for k in saved}) == []

    damaged = tmp_path / "damaged"
    shutil.copytree(reference, damaged)
    shard = checkpoint_path(damaged, NUM_ROLLOUT - 1) / OPTIMIZER_DIR / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = cli(capsys, "ckpt", "verify", damaged)
    assert code == 1
    assert "CORRUPT" in err and "__1_0.distcp" in err, err


# ---------------------------------------------------------------- crash anywhere at N=2


@pytest.fixture(scope="module")
def chain(reference, tmp_path_factory) -> tuple[list[Outcome], list[str]]:
    save = tmp_path_factory.mktemp("dist_chain") / "run"

    def next_kill(outcomes: list[Outcome]) -> Kill | None:
        last = outcomes[-1] if outcomes else None
        if last is not None and not last.died and last.problems:
            return None  # a launch failed by itself: the chain is broken, stop spending launches
        return CHAIN[len(outcomes)][0] if len(outcomes) < len(CHAIN) else None

    outcomes = run_with_kills(
        ARGS, save, next_kill, max_reruns=2, nproc=NPROC, env=torchrun_env(), timeout=300
    )
    return outcomes, compare_runs(reference, save)


def test_n2_kills_each_killed_a_rank_where_aimed(chain):
    outcomes, _ = chain
    table = outcome_table(outcomes)
    assert len(CHAIN) >= 10 and len(outcomes) == len(CHAIN), table
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    assert [(o.rollout, o.tracker) for o in outcomes] == [(r, t) for _, r, t in CHAIN], table


def test_n2_kills_resume_to_the_uninterrupted_tensors_and_metrics(chain):
    outcomes, diffs = chain
    table = outcome_table(outcomes)
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
        assert outcome.intact and outcome.resumed, table
    # after the first commit every launch resumed at N=2
    assert [o.resumed_at for o in outcomes][len(CHAIN) // 2 :] == [1] * (len(CHAIN) // 2), table
    assert diffs == [], table


# ---------------------------------------------------------------- signals and the lock


def test_sigterm_to_torchrun_saves_on_all_ranks_and_they_agree_on_the_stop(builtin_model, tmp_path):
    save = tmp_path / "term"
    args = [*ARGS[:1], "50", *ARGS[2:]]  # long enough to be stopped halfway
    proc = subprocess.Popen(
        train_command(args, save, NPROC),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(save) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert read_metrics(save), "no rollout finished in time"
        proc.send_signal(signal.SIGTERM)  # torchrun alone; it forwards SIGTERM to every rank
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    logged = read_metrics(save)[-1]["rollout_id"]
    assert logged < 49
    assert f"stopped after rollout {logged} (SIGTERM)" in stdout, stderr[-2000:]
    assert read_tracker(save).iteration == logged
    assert verify_checkpoint(checkpoint_path(save, logged)) == []
    # both workers stopped alike (exit 75, never killed); torchrun reports the signal it got
    assert "exitcode  : -" not in stderr and "exitcode  : 1" not in stderr, stderr[-2000:]


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_sigkilled_torchrun_takes_its_workers_with_it_and_the_rerun_resumes(
    builtin_model, tmp_path
):
    """torchrun starts each worker in a session of its own. Killed alone (as an OOM killer or
    `kill -9 PID` would) while its workers start up, it used to leave them waiting for a
    rendezvous that never came, for minutes, holding the output pipes of whoever started it."""
    save = tmp_path / "killed"
    args = [*ARGS[:1], "3", *ARGS[2:]]
    proc = subprocess.Popen(
        train_command(args, save, NPROC),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **torchrun_env()},
        cwd=REPO,
        start_new_session=True,
    )
    workers = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < NPROC and time.monotonic() < deadline:
            workers = children_of(proc.pid)
            time.sleep(0.02)
        assert len(workers) == NPROC, "torchrun started no workers"
        proc.kill()  # torchrun alone, while its workers import and rendezvous
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [w for w in workers if alive(w)] == [], "workers outlived torchrun"
    finally:
        for pid in [proc.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    done = run_train(args, save, nproc=NPROC)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["rollout_id"] for r in read_metrics(save)] == [0, 1, 2]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_second_torchrun_job_on_a_save_in_use_exits_2_on_every_rank(builtin_model, tmp_path):
    save = tmp_path / "locked"
    with SaveDirLock(save):
        done = run_train(ARGS, save, NPROC)
    assert done.returncode == 1  # torchrun's code for failed workers
    assert done.stderr.count("is in use by another mileage run") == NPROC, done.stderr[-2000:]
    assert done.stderr.count("exitcode  : 2") >= 1
    assert not (save / METRICS_FILE).exists()


# ---------------------------------------------------------------- pure pieces, in process


def test_shares_cover_every_item_once_in_order():
    for count in range(0, 11):
        for parts in (1, 2, 3, 4):
            ranges = [env.share(count, parts, i) for i in range(parts)]
            assert [i for r in ranges for i in r] == list(range(count))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_single_process_micro_batches_are_the_old_ones():
    assert env.micro_batches(16, 16, 4) == [(16, 20), (20, 24), (24, 28), (28, 32)]


def test_plan_names_a_world_size_change_and_only_then(tmp_path):
    from mileage.checkpoint.layout import CheckpointInfo, DirState, parse_tracker
    from mileage.checkpoint.plan import DiskState

    info = CheckpointInfo(str(tmp_path / "iter_0000003"), True, "", {"world_size": 2})
    state = DirState(
        str(tmp_path),
        True,
        tracker=parse_tracker("3"),
        checkpoints={3: info},
    )
    disk = DiskState(state, state, None, None, None)
    for world, changed in ((2, False), (1, True), (4, True)):
        flags = StartFlags("hf", 10, load=str(tmp_path), save=str(tmp_path), world_size=world)
        plan = plan_start(flags, disk)
        assert plan.action == RESUME and plan.start_rollout_id == 4
        said = [r for r in plan.reasons if r.startswith("world size changed")]
        assert bool(said) == changed, plan.reasons


def test_rng_of_each_rank_round_trips_and_fewer_ranks_fall_back_to_rank_0(monkeypatch):
    saved = {"torch_cpu": torch.tensor([1]), "rank1.torch_cpu": torch.tensor([2])}
    monkeypatch.setenv("RANK", "1")
    assert torch.equal(rng_of_this_rank(saved)["torch_cpu"], torch.tensor([2]))
    monkeypatch.setenv("RANK", "3")
    assert torch.equal(rng_of_this_rank(saved)["torch_cpu"], torch.tensor([1]))
    monkeypatch.setenv("RANK", "0")
    assert torch.equal(rng_of_this_rank(saved)["torch_cpu"], torch.tensor([1]))
    assert gather_rng({"torch_cpu": torch.tensor([1])}).keys() == {"torch_cpu"}
