"""`mileage train` with rollout on `mileage serve` servers through the SGLang client engine:
two servers, servers that follow the trained weights, an exact resume after kills, and servers
that die, hang or answer garbage.

Every run trains the built-in model, whose rewards vary within groups: the weights move, so a
comparison of two runs fails when weight sync, seeding or resume is broken (on a model whose
gradients are all 0, every run would end with the starting weights). The servers are started
once for the module; each run syncs its own weights to them when it starts.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from conftest import assert_learned, builtin_train_args, fast_train_args

from mileage.checkpoint.layout import checkpoint_path, read_tracker, scan_dir
from mileage.checkpoint.store import verify_checkpoint
from mileage.checkpoint.tensors import MODEL_DIR, load_tensors
from mileage.cli.main import main
from mileage.errors import UserError
from mileage.metrics import TIMING_KEYS, read_metrics
from mileage.models.hf import load_causal_lm, load_tokenizer
from mileage.rollout.data import Prompt
from mileage.rollout.engine import LocalEngine, SamplingParams
from mileage.rollout.engines.http import ServerPool, post_json
from mileage.rollout.rewards.rules import exact_reward
from mileage.rollout.rollout import PromptEncoder, generate_samples
from mileage.testing.compare import compare_checkpoints, compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill
from mileage.testing.servers import SAME_HEAD_AS_TRAINER, ServeProcess, start_servers

# 32 samples a rollout in two optimizer steps, so a kill can land between them
TRAIN = builtin_train_args("--global-batch-size", "16", "--rollout-shuffle")
# the engine's log-probs against the trainer's recomputed ones: the same weights agree to the
# rounding of their kernels (in bf16 the engine's decode and the trainer's forward may take
# different ones: 1.3e-4 apart on an Intel Xeon with AMX, ~1e-7 on an AMD EPYC); the weights of
# the rollout before are off by ~1e-2
MISMATCH_TOLERANCE = 1e-3
PROBE_SEED = 77


def train_args(urls, num_rollout: int, *extra: str) -> list[str]:
    flags = ["--rollout-engine", "sglang", "--rollout-timeout", "8", "--rollout-sync-timeout", "8"]
    for url in urls:
        flags += ["--rollout-url", url]
    return [*TRAIN, *flags, "--num-rollout", str(num_rollout), *extra]


# a server per fault test: the n-th /generate request it gets dies, hangs or answers garbage
FAULTS = ("die:3", "hang:3", "garbage:3", "die:9")


@dataclass
class Servers:
    healthy: list[ServeProcess]  # ready
    faulty: dict[str, ServeProcess]  # started, maybe not ready yet: `wait_ready` first

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.healthy]


@pytest.fixture(scope="module")
def servers(builtin_model):
    healthy = start_servers(builtin_model, 2, args=SAME_HEAD_AS_TRAINER)
    # started now, they load while the reference run trains instead of when their test comes
    faulty = {
        f: ServeProcess(builtin_model, {"MILEAGE_SERVE_FAULT": f}, SAME_HEAD_AS_TRAINER)
        for f in FAULTS
    }
    yield Servers(healthy, faulty)
    for server in [*healthy, *faulty.values()]:
        server.stop()


def probe_prompt(model_dir: Path) -> list[int]:
    return load_tokenizer(model_dir)("12+34=")["input_ids"]


def probe_server(url: str, prompt: list[int]) -> dict:
    """What a server holds now: its weight version and its seeded sample of `prompt`."""
    with urllib.request.urlopen(url + "/get_model_info", timeout=30) as reply:
        version = json.loads(reply.read())["weight_version"]
    params = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "sampling_seed": PROBE_SEED}
    out = post_json(
        url + "/generate",
        {"input_ids": [prompt], "sampling_params": [params], "return_logprob": True},
        timeout=60,
    )[0]
    pairs = out["meta_info"]["output_token_logprobs"]
    return {"version": version, "tokens": [p[1] for p in pairs], "logprobs": [p[0] for p in pairs]}


def local_sample(model: torch.nn.Module, model_dir: Path, prompt: list[int]):
    """What a `mileage serve` of `model` samples: in its default --dtype auto's precision."""
    from mileage.precision import resolve, set_precision

    set_precision(model, resolve("auto", torch.device("cpu"))[0])
    tokenizer = load_tokenizer(model_dir)
    engine = LocalEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    generator = torch.Generator().manual_seed(PROBE_SEED)
    (done,) = engine.generate([prompt], SamplingParams(4, 1.0, 1.0), [generator])
    return done.response_ids, done.logprobs


def checkpoint_model(model_dir: Path, save: Path) -> torch.nn.Module:
    """The HF model with the weights of the checkpoint the tracker of `save` names."""
    model = load_causal_lm(model_dir)
    tensors = load_tensors(checkpoint_path(save, read_tracker(save).iteration) / MODEL_DIR)
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and len(tensors) > 0
    return model.eval()


@dataclass
class Reference:
    save: Path
    served: list[dict]  # each server's `probe_server` right after the run


@pytest.fixture(scope="module")
def reference(servers, builtin_model, tmp_path_factory):
    """Two rollouts through two servers, saved after each; then what the servers serve."""
    save = tmp_path_factory.mktemp("reference") / "run"
    run_uninterrupted(train_args(servers.urls, 2), save)
    assert_learned(save, builtin_model)
    prompt = probe_prompt(builtin_model)
    return Reference(save, [probe_server(url, prompt) for url in servers.urls])


def test_two_rollouts_on_two_servers_learn_and_the_servers_follow_the_weights(
    reference, builtin_model
):
    records = read_metrics(reference.save)
    assert [r["rollout_id"] for r in records] == [0, 1]
    # each rollout was generated by the weights the trainer had: the servers got every update
    assert all(0 <= r["logprob_abs_diff"] < MISMATCH_TOLERANCE for r in records), records
    # after the run both servers hold the last version, and sample exactly what the trained
    # weights sample, which is not what the starting weights sample
    prompt = probe_prompt(builtin_model)
    trained = local_sample(checkpoint_model(builtin_model, reference.save), builtin_model, prompt)
    start = local_sample(load_causal_lm(builtin_model).eval(), builtin_model, prompt)
    for served in reference.served:
        assert served["version"] == str(records[-1]["global_step"])
        assert served["tokens"] == trained[0]
        assert max(abs(a - b) for a, b in zip(served["logprobs"], trained[1], strict=True)) < 1e-5
        moved = [abs(a - b) for a, b in zip(served["logprobs"], start[1], strict=False)]
        assert served["tokens"] != start[0] or max(moved) > 1e-3, (served, start)


def test_partial_rollout_continues_answers_on_the_servers(servers, builtin_model, tmp_path):
    """--partial-rollout through `mileage serve`: an unfinished answer goes back to a server as
    input ids (prompt + partial answer) once the servers hold newer weights. With the older
    tokens masked, the mismatch covers only the tokens each server just wrote, which the
    trainer's recompute of the whole sequence reproduces to float rounding; a continuation from
    the wrong prefix would not."""
    save = tmp_path / "partial"
    flags = ["--partial-rollout", "--partial-rollout-round-tokens", "1"]
    flags += ["--over-sampling-batch-size", "10", "--mask-offpolicy-in-partial-rollout"]
    run_uninterrupted(train_args(servers.urls, 3, *flags), save)
    assert_learned(save, builtin_model)
    records = read_metrics(save)
    assert sum(r["partial_rollout/groups_resumed"] for r in records) > 0, records
    assert sum(r["partial_rollout/offpolicy_masked"] for r in records) > 0, records
    assert all(0 <= r["logprob_abs_diff"] < MISMATCH_TOLERANCE for r in records), records


def test_one_server_draws_the_samples_of_two(reference, servers, builtin_model, tmp_path):
    one = tmp_path / "one"
    run_uninterrupted(train_args(servers.urls[1:], 2), one)
    assert_learned(one, builtin_model)
    assert compare_runs(reference.save, one) == []


def test_weights_by_broadcast_equal_weights_from_disk(reference, servers, builtin_model, tmp_path):
    """--rollout-weight-sync broadcast: both servers join one gloo group with the trainer (SGLang's
    init_weights_update_group) and receive every update by broadcast (update_weights_from_
    distributed) in buckets of --update-weight-buffer-size bytes (here a third of the model, so
    every update takes several calls). The run equals the disk-synced reference bit for bit,
    and the servers end on the trained weights."""
    save, disk = tmp_path / "broadcast", tmp_path / "weights"
    model_bytes = sum(t.numel() * 4 for t in load_causal_lm(builtin_model).state_dict().values())
    flags = ["--rollout-weight-sync", "broadcast", "--rollout-weights-dir", str(disk),
             "--update-weight-buffer-size", str(model_bytes // 3)]  # fmt: skip
    done = run_uninterrupted(train_args(servers.urls, 2, *flags), save)
    buckets = re.search(r"weights by broadcast in (\d+) bucket\(s\) .* as float32", done.stdout)
    assert buckets and int(buckets.group(1)) >= 3, done.stdout
    assert not disk.exists() or not any(disk.iterdir())  # nothing went through the disk
    assert_learned(save, builtin_model)
    assert compare_runs(reference.save, save) == []
    prompt = probe_prompt(builtin_model)
    assert [probe_server(url, prompt) for url in servers.urls] == reference.served


def same_as_reference(reference: Path, save: Path) -> list[str]:
    """Differences between `save` and the first rollouts of the reference run."""
    diffs = []
    for rollout_id in scan_dir(save).complete_ids:
        diffs += compare_checkpoints(
            checkpoint_path(reference, rollout_id), checkpoint_path(save, rollout_id)
        )
    records = [without_timing(r) for r in read_metrics(save)]
    if records != [without_timing(r) for r in read_metrics(reference)][: len(records)]:
        diffs.append("metrics differ")
    return diffs


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING_KEYS}


def test_tis_and_rollout_logprobs(reference, servers, builtin_model, tmp_path):
    runs = {}
    for name, extra in {"tis": ["--use-tis", "--tis-clip", "1.0", "--tis-clip-low", "1.0"],
                        "rollout": ["--use-rollout-logprobs"]}.items():  # fmt: skip
        run_uninterrupted(train_args(servers.urls, 1, *extra), tmp_path / name)
        assert_learned(tmp_path / name, builtin_model)
        runs[name] = without_timing(read_metrics(tmp_path / name)[0])
    first = without_timing(read_metrics(reference.save)[0])
    # TIS weights clamped to exactly 1 are reported and change nothing: the reference's update
    tis = runs["tis"]
    assert tis.pop("tis_mean") == 1.0 and 0 < tis.pop("tis_clipfrac") <= 1
    assert tis == first
    assert (
        compare_checkpoints(
            checkpoint_path(reference.save, 0), checkpoint_path(tmp_path / "tis", 0)
        )
        == []
    )
    # the engine's log-probs as the old policy: the same samples, another update
    rollout = runs["rollout"]
    assert "tis_mean" not in rollout
    assert rollout["prompt_indices"] == first["prompt_indices"]
    assert rollout["reward_mean"] == first["reward_mean"]
    assert rollout["logprob_abs_diff"] == first["logprob_abs_diff"]
    assert rollout != first


def test_resume_through_mileage_serve_is_bit_exact(reference, servers, tmp_path):
    # the servers in the other order: request i starts on the other server than in the reference
    args = train_args(servers.urls[::-1], 2)
    kills = [
        Kill.at("after_generate"),
        Kill.at("optimizer_step", 2),  # between the two optimizer steps of rollout 0
        Kill.at("save_after_model"),
        Kill.at("after_train", 2),  # rollout 1's weights are on the servers, not in a checkpoint
        Kill.at("commit_before_tracker"),
        Kill.at("after_metrics"),
    ]
    outcomes = run_with_kills(args, tmp_path / "killed", kills)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert [o.tracker for o in outcomes] == [None, None, None, 0, 0, 0], table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference.save, tmp_path / "killed") == [], table


@pytest.mark.parametrize(
    ("fault", "num_rollout"),
    # the third /generate request of the faulty server is in rollout 0; a dead server also
    # misses the weight sync, and rollout 1 runs without it
    [("die:3", 2), ("hang:3", 1), ("garbage:3", 1)],
)
def test_a_faulty_server_is_retried_on_the_other(fault, num_rollout, reference, servers, tmp_path):
    faulty = servers.faulty[fault]
    faulty.wait_ready()
    save = tmp_path / "run"
    run_uninterrupted(train_args([faulty.url, servers.urls[0]], num_rollout), save)
    if fault.startswith("die"):
        assert not faulty.alive()
    assert read_tracker(save).iteration == num_rollout - 1
    # the retried groups drew the same samples
    assert same_as_reference(reference.save, save) == []


def test_when_every_try_fails_the_run_stops_and_a_rerun_continues(
    reference, servers, tmp_path, cli
):
    save = tmp_path / "run"
    # one server, 8 requests a rollout: its 9th request is rollout 1's first
    dying = servers.faulty["die:9"]
    dying.wait_ready()
    args = train_args([dying.url], 2, "--rollout-attempts", "2")
    failed = cli("train", *args, "--save", save, "--save-interval", 1)
    assert failed.returncode == 2
    lines = failed.stderr.strip().splitlines()
    assert lines[-1].startswith("mileage: error: sglang rollout: /generate failed after 2 tries")
    assert "Traceback" not in failed.stderr
    assert read_tracker(save).iteration == 0
    assert verify_checkpoint(checkpoint_path(save, 0)) == []
    again = cli("train", *train_args(servers.urls[:1], 2), "--save", save, "--load", save,
                "--save-interval", 1)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "resume at rollout 1" in again.stdout
    assert compare_runs(reference.save, save) == []


class LaggingEngine(LocalEngine):
    """Reports the version it was given but answers with the previous one's samples, as a
    server whose reload has not finished would."""

    def generate(self, prompts, params, seed=None, group_size=1):
        done = super().generate(prompts, params, seed, group_size)
        return [replace(c, weight_version=self.weight_version - 1) for c in done]


def test_samples_of_an_older_weight_version_are_refused(tiny_hf):
    tokenizer = load_tokenizer(tiny_hf)
    engine = LaggingEngine(load_causal_lm(tiny_hf), tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine.update_weights(engine.model, 5)
    prompts = [Prompt(0, "1+1=", "2"), Prompt(1, "2+2=", "4")]
    encode = PromptEncoder(tokenizer, chat_template=False)
    with pytest.raises(UserError, match="weight version 4, expected 5; refusing to train"):
        generate_samples(engine, encode, prompts, SamplingParams(3), 2, exact_reward, 1, 7)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rollout-engine", "sglang"], "needs --rollout-url"),
        (["--rollout-url", "http://127.0.0.1:1"], "needs --rollout-engine"),
        (["--rollout-engine", "sglang", "--rollout-url", "localhost:1"], "http://"),
        (
            [
                "--rollout-engine",
                "sglang",
                "--rollout-url",
                "http://127.0.0.1:1",
                "--use-tis",
                "--use-rollout-logprobs",
            ],
            "--use-tis corrects",
        ),  # fmt: skip
        (["--rollout-weight-sync", "broadcast"], "--rollout-engine local syncs through the disk"),
    ],
)
def test_engine_flags_are_checked(args, message, tiny_hf, capsys, mileage_home):
    code = main(["train", *fast_train_args(tiny_hf, *args, "--num-rollout", "1")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and err.startswith("mileage: error: ")


def test_a_reply_cut_off_mid_body_is_a_bad_reply_not_a_traceback():
    """A server that dies while answering leaves a body shorter than its Content-Length;
    urllib raises http.client.IncompleteRead, which is not an OSError."""
    import socket
    import threading

    from mileage.rollout.engines.http import BadReply, post_json

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_half() -> None:
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:  # the whole request first: unread bytes at
                request += conn.recv(65536)  # close would reset the connection instead
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"choi')

    thread = threading.Thread(target=answer_half, daemon=True)
    thread.start()
    try:
        with pytest.raises(BadReply, match="broken reply"):
            post_json(f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1]}, timeout=10)
    finally:
        thread.join(timeout=10)
        listener.close()


def test_a_weight_sync_excludes_the_servers_that_missed_it_and_stops_when_all_did():
    """`ServerPool.sync`, the one home of both remote engines' sync policy."""
    pool = ServerPool(["http://a", "http://b"], timeout=1.0, attempts=2, what="test rollout")
    answers = {"/load": {"http://a": None, "http://b": "refused"}, "/label": {}}

    def broadcast(path, payload, timeout, text_ok=False):
        return {url: answers[path].get(url) for url in pool.urls}

    pool.broadcast = broadcast
    pool.failed = {"http://a", "http://b"}  # both failed a request before this sync
    pool.sync([("/load", {}), ("/label", {})], 3, 1.0)
    assert pool.excluded == {"http://b"}  # it would sample from the old weights
    assert pool.failed == {"http://b"}  # a has just answered: tried first again
    assert pool._order(0) == ["http://a"]

    answers["/label"] = {"http://a": "timed out"}  # a fails a later step: no server is left
    with pytest.raises(UserError) as caught:
        pool.sync([("/load", {}), ("/label", {})], 4, 1.0)
    assert str(caught.value).startswith(
        "test rollout: no server loaded the weights of version 4 "
        "(http://b: /load: refused; http://a: /label: timed out)"
    )
