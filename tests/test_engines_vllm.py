"""`--rollout-engine vllm`: mileage launches the server, syncs weights and stops it, and no
server process outlives a SIGKILLed mileage. A fake `vllm` package (vLLM's OpenAI completions
and dev-mode reload endpoints in front of mileage's own engine) stands in for vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_learned, builtin_train_args, fast_train_args
from safetensors.torch import load_file

from mileage.metrics import read_metrics
from mileage.rollout.engine import SamplingParams
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.http import BadReply
from mileage.rollout.engines.vllm import VLLMEngine
from mileage.rollout.engines.vllm_server import launch_args
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

FAKE_SERVER = """
import argparse, json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from mileage.seeding import configure_determinism
from mileage.serve.server import EngineServer

parser = argparse.ArgumentParser()
parser.add_argument("--model"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name"); parser.add_argument("--tokenizer")
parser.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
parser.add_argument("--enable-lora", action="store_true"); parser.add_argument("--max-lora-rank", type=int)
args, _ = parser.parse_known_args()
# vLLM answers /v1/load_lora_adapter only with this set (FAKE_VLLM_NO_RUNTIME_LORA: as if unset)
runtime_lora = (os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True"
                and not os.environ.get("FAKE_VLLM_NO_RUNTIME_LORA"))
# a child of the server, as vLLM's engine-core process is: it must die with the server
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["FAKE_VLLM_PIDS"], "a") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")
configure_determinism(0, 1)
# --model holds weights only (no tokenizer); it computes in the --dtype the trainer asked for,
# with its LM head in that dtype too, as vLLM does
engine = EngineServer(args.tokenizer, {"float32": "fp32", "bfloat16": "bf16"}[args.dtype],
                      enable_lora=args.enable_lora, fp32_lm_head=False)
calls = []

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def text(self, code, message):  # vLLM answers its LoRA endpoints with a sentence
        data = message.encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self.reply({})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/collective_rpc":
            assert body["method"] == "reload_weights" and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
            engine.update_weights({"model_path": body["kwargs"]["weights_path"]})
            with open(os.environ["FAKE_VLLM_RELOADS"], "a") as f:
                f.write(body["kwargs"]["weights_path"] + "\\n")
            return self.reply({"results": [None]})
        if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            if not runtime_lora:
                return self.text(404, '{"detail": "Not Found"}')
            load = self.path == "/v1/load_lora_adapter"
            assert not load or args.max_lora_rank >= 8
            result = (engine.lora.load_from_disk if load else engine.lora.unload)(body)
            if not result["success"]:
                return self.text(400, result["error_message"])
            with open(os.environ["FAKE_VLLM_RELOADS"], "a") as f:
                f.write(f"{self.path} {body['lora_name']}\\n")
            return self.text(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if self.path == "/reset_prefix_cache":
            return self.reply({"success": True})
        if self.path == "/update_weight_version":
            return self.reply({"success": True, "new_version": body["new_version"]})
        adapter = None if body["model"] == args.served_model_name else body["model"]
        assert adapter is None or adapter in engine.lora.adapters.paths, body["model"]
        assert body["return_token_ids"]
        calls.append(body)
        if len(calls) == int(os.environ.get("FAKE_VLLM_DIE_AFTER", "0")):
            marker = os.environ.get("FAKE_VLLM_DIE_ONCE")  # else every instance dies
            if not (marker and os.path.exists(marker)):
                if marker:
                    open(marker, "w").close()
                os._exit(1)  # mid-rollout, with requests in flight
        assert body["top_k"] == 0 and body["repetition_penalty"] == 1.0
        out = engine.generate({"input_ids": body["prompt"], "sampling_params": {
            "max_new_tokens": body["max_tokens"], "temperature": body["temperature"],
            "top_p": body["top_p"], "sampling_seed": body.get("seed")}, "lora_path": adapter})
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]
        self.reply({"choices": [{"index": 0, "finish_reason": meta["finish_reason"]["type"],
            "token_ids": [t for _, t, _ in pairs], "prompt_token_ids": body["prompt"],
            "logprobs": {"tokens": [f"token_id:{t}" for _, t, _ in pairs],
                         "token_logprobs": [lp for lp, _, _ in pairs]}}]})

ThreadingHTTPServer.request_queue_size = 1024  # 64 connections at once; the default backlog is 5
ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path) -> dict[str, str]:
    package = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    pids = tmp_path / "pids.txt"
    return {
        "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{REPO}",
        "FAKE_VLLM_PIDS": str(pids),
        "FAKE_VLLM_RELOADS": str(tmp_path / "reloads.txt"),
    }


def vllm_args(tiny_hf, *extra) -> list[str]:
    return [
        *fast_train_args(tiny_hf, "--rollout-engine", "vllm", "--vllm-python", sys.executable,
                         "--vllm-start-timeout", "120", *extra),
    ]  # fmt: skip


def server_pids(env) -> list[int]:
    path = Path(env["FAKE_VLLM_PIDS"])
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's bookkeeping remains


def wait_dead(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_launched_server_trains_with_weight_sync_and_is_stopped(
    cli, builtin_model, fake_vllm, tmp_path
):
    # the built-in model learns, so each sync hands the server other weights than it has
    save = tmp_path / "run"
    args = builtin_train_args("--rollout-engine", "vllm", "--vllm-python", sys.executable,
                              "--vllm-start-timeout", "120", "--global-batch-size", "16")  # fmt: skip
    done = cli("train", *args, "--num-rollout", "2", "--save", save, env=fake_vllm)
    assert done.returncode == 0, done.stderr
    assert "launching vLLM on http://127.0.0.1:" in done.stdout
    assert_learned(save, builtin_model)
    records = read_metrics(save)
    assert [r["rollout_id"] for r in records] == [0, 1]
    # rollout 1 was sampled with rollout 0's trained weights: the server reloaded them
    assert all(r["logprob_abs_diff"] < 1e-4 for r in records), records
    # one reload when the run starts and one after each rollout's training
    reloads = Path(fake_vllm["FAKE_VLLM_RELOADS"]).read_text().splitlines()
    assert len(reloads) == 3
    pids = server_pids(fake_vllm)
    assert len(pids) == 2 and wait_dead(pids) == []


def test_a_launched_server_that_dies_mid_rollout_is_restarted_and_the_run_is_exact(
    cli, builtin_model, fake_vllm, tmp_path
):
    """The server dies at its 5th completion of rollout 1 (of 2): mileage restarts it on the
    current weights, sends the rollout's requests again, and (per-row seeds) ends with the
    tensors and metrics of a run whose server never died. Both servers are gone at the end."""
    args = builtin_train_args("--rollout-engine", "vllm", "--vllm-python", sys.executable,
                              "--vllm-start-timeout", "120", "--global-batch-size", "16",
                              "--num-rollout", "2", "--rollout-timeout", "20")  # fmt: skip
    clean = tmp_path / "clean"
    done = cli("train", *args, "--save", clean, env=fake_vllm)
    assert done.returncode == 0, done.stderr
    dying = {**fake_vllm, "FAKE_VLLM_DIE_AFTER": "37", "FAKE_VLLM_DIE_ONCE": str(tmp_path / "died")}
    Path(fake_vllm["FAKE_VLLM_PIDS"]).unlink()
    restarted = tmp_path / "restarted"
    done = cli("train", *args, "--save", restarted, env=dying)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "died").exists()  # 32 completions per rollout: it died in rollout 1
    assert "the launched vLLM server failed" in done.stdout, done.stdout
    assert "restarting it with the weights of version 2" in done.stdout, done.stdout
    assert_learned(restarted, builtin_model)
    assert compare_runs(clean, restarted) == []
    pids = server_pids(dying)
    assert len(pids) == 4 and wait_dead(pids) == []


def test_a_server_that_keeps_dying_stops_the_run_with_one_line(cli, tiny_hf, fake_vllm, tmp_path):
    dying = {**fake_vllm, "FAKE_VLLM_DIE_AFTER": "3"}
    save = tmp_path / "run"
    done = cli("train", *vllm_args(tiny_hf, "--rollout-timeout", "20"), "--save", save, env=dying)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mileage: error: vllm rollout: /v1/completions")
    assert "rerun the same command" in lines[0]
    assert (
        done.stdout.count("restarting it with the weights of version 0") == 1
    )  # --vllm-restarts 1
    pids = server_pids(dying)
    assert len(pids) == 4 and wait_dead(pids) == []


def test_no_server_survives_a_sigkill_of_mileage(tiny_hf, fake_vllm, mileage_home):
    env = {**os.environ, **fake_vllm, "PYTHONUNBUFFERED": "1"}
    train = subprocess.Popen(
        [sys.executable, "-m", "mileage", "train", *vllm_args(tiny_hf), "--num-rollout", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        for line in train.stdout:
            if "vLLM is up" in line or time.monotonic() > deadline:
                break
        pids = server_pids(fake_vllm)
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        train.send_signal(signal.SIGKILL)
        train.wait(timeout=30)
    assert wait_dead(pids) == []


def test_missing_vllm_python_is_one_line(cli, tiny_hf, tmp_path):
    done = cli("train", *fast_train_args(tiny_hf, "--rollout-engine", "vllm", "--vllm-python",
                                         str(tmp_path / "nope")))  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"mileage: error: --vllm-python {tmp_path / 'nope'} does not exist; install vLLM with "
        "scripts/install_vllm.sh or give --rollout-url of a running server"
    ]


def test_launch_defaults_give_way_to_the_users_flags():
    assert launch_args("") == [
        "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm", "--enforce-eager", "--kv-cache-memory-bytes", "1G",
    ]  # fmt: skip
    assert launch_args("", "bfloat16")[:2] == ["--dtype", "bfloat16"]  # a bf16 trainer's
    assert launch_args("--gpu-memory-utilization 0.5 --dtype=bfloat16 --no-enforce-eager") == [
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--gpu-memory-utilization", "0.5", "--dtype=bfloat16", "--no-enforce-eager",
    ]  # fmt: skip


@pytest.mark.parametrize(("mode", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_a_launched_server_gets_the_trainers_precision_as_dtype(tiny_hf, mode, dtype):
    from transformers import AutoModelForCausalLM

    from mileage.precision import set_precision
    from mileage.rollout.engines.factory import build_engine

    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf), mode)
    cfg = EngineConfig(rollout_engine="vllm")
    engine = build_engine(cfg, model, 0, 2, str(tiny_hf), print)
    assert isinstance(engine, VLLMEngine) and engine.dtype == dtype


def completion(prompt, tokens, logprobs, finish="stop", echoed=None) -> dict:
    """A /v1/completions reply as vLLM 0.32 shapes it (return_token_ids, logprobs=0)."""
    return {"choices": [{
        "index": 0, "finish_reason": finish, "token_ids": tokens,
        "prompt_token_ids": prompt if echoed is None else echoed,
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs},
    }]}  # fmt: skip


def test_completion_replies_are_read_and_checked(tmp_path):
    cfg = EngineConfig(rollout_engine="vllm", rollout_url=["http://127.0.0.1:9"],
                       rollout_weights_dir=str(tmp_path / "w"))  # fmt: skip
    engine = VLLMEngine(cfg, vocab_size=50, eos_id=2, model_dir="unused", log=print)
    engine.weight_version = 7
    try:
        validate = engine._validator([1, 5, 6], SamplingParams(max_new_tokens=4))
        done = validate(completion([1, 5, 6], [9, 2], [-0.5, -0.25]))
        assert (done.response_ids, done.logprobs, done.finished, done.weight_version) == (
            [9, 2], [-0.5, -0.25], True, 7)  # fmt: skip
        cut = validate(completion([1, 5, 6], [9, 9, 9, 9], [-1.0] * 4, finish="length"))
        assert not cut.finished
        for reply, why in (
            (completion([1, 5, 6], [9, 2], [-0.5, -0.25], echoed=[5, 6]), "another prompt"),
            (completion([1, 5, 6], [9, 2], [-0.5]), "2 tokens, 1 log-probs"),
            (completion([1, 5, 6], [9, 77], [-0.5, -0.25]), "outside the vocabulary"),
            (completion([1, 5, 6], [9, 2], [-0.5, 0.3]), "finite number <= 0"),
            (completion([1, 5, 6], [9, 2], [-0.5, -0.25], finish="abort"), "finish_reason"),
            ({"choices": []}, "malformed"),
        ):
            with pytest.raises(BadReply, match=why):
                validate(reply)
    finally:
        engine.close()


def test_weights_for_vllm_have_their_own_lm_head(tiny_hf, tmp_path):
    """vLLM's in-place reload skips a tied head; the directory it reloads from unties it."""
    from transformers import AutoModelForCausalLM

    from mileage.rollout.engines.vllm import untie_on_disk
    from mileage.rollout.engines.weights import DiskWeights

    model = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(0.5)  # a trained step moves the tied matrix
    weights = DiskWeights(str(tmp_path / "w"))
    path = weights.write(model)
    untie_on_disk(model, path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert not reloaded.config.tie_word_embeddings
    assert "lm_head.weight" in load_file(path / "model.safetensors")
    assert torch.equal(reloaded.lm_head.weight, model.get_input_embeddings().weight)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_a_killed_runs_temporary_weights_are_removed_by_the_next_run(tmp_path, monkeypatch):
    """A run killed mid-training leaves its temporary weights directory (a whole model's copy);
    the next run's first write removes it, leaving live writers' and unstamped ones alone."""
    import tempfile

    from mileage.rollout.engines import weights as weights_module

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    dead = tmp_path / f"mileage-weights-{exited.pid}-abc"
    live = tmp_path / f"mileage-weights-{os.getppid()}-def"
    unstamped = tmp_path / "mileage-weights-x1y2z3"
    for path in (dead, live, unstamped):
        (path / "current").mkdir(parents=True)
        (path / "current" / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    disk = weights_module.DiskWeights(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (dead, live, unstamped)
    ), "a directory before the first write"
    root = disk.root
    assert root.name.startswith(f"mileage-weights-{os.getpid()}-")
    assert not dead.exists() and live.exists() and unstamped.exists()
    disk.close()
    assert not root.exists()
    kept = weights_module.DiskWeights(str(tmp_path / "given"))
    assert kept.root == tmp_path / "given"
    kept.close()
    assert (tmp_path / "given").is_dir(), "--rollout-weights-dir is the user's"


def test_train_async_through_a_launched_server_resumes_bit_for_bit(
    cli, builtin_model, fake_vllm, tmp_path
):
    """train-async with `--rollout-engine vllm`: the server generates slot N+1 (with the weights
    of before N's update, which it was last reloaded with) while rollout N trains; the samples
    carry the server's weight version; killed while slot 1 generates and after the first
    commit (slot 1 buffered), the run resumes to the uninterrupted one bit for bit."""
    from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
    from mileage.testing.kills import Kill

    args = builtin_train_args("--rollout-engine", "vllm", "--vllm-python", sys.executable,
                              "--vllm-start-timeout", "120", "--global-batch-size", "16",
                              "--num-rollout", "3")  # fmt: skip
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference, env=fake_vllm, subcommand="train-async")
    assert_learned(reference, builtin_model)
    records = read_metrics(reference)
    assert [r["staleness_max"] for r in records] == [0, 1, 1]
    # one reload at the start, one after each rollout: slots 0 and 1 came from the first
    reloads = Path(fake_vllm["FAKE_VLLM_RELOADS"]).read_text().splitlines()
    assert len(reloads) == 4
    save = tmp_path / "run"
    kills = [Kill.at("async_generating", 2), Kill.at("commit_after_tracker")]
    outcomes = run_with_kills(args, save, kills, env=fake_vllm, subcommand="train-async")
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table


# ---------------------------------------------------------------- under torchrun (N=2)


def torchrun_vllm_args(weights_dir: Path) -> list[str]:
    return builtin_train_args(
        "--rollout-engine", "vllm", "--vllm-python", sys.executable, "--vllm-start-timeout",
        "120", "--global-batch-size", "16", "--num-rollout", "2", "--rollout-timeout", "60",
        "--rollout-weights-dir", str(weights_dir),
    )  # fmt: skip


@pytest.mark.slow
def test_torchrun_n2_trains_through_a_vllm_server_that_rank_0_launches_and_resumes_exactly(
    builtin_model, fake_vllm, tmp_path
):
    """Rank 0 launches the server, sends every request and writes the weights it reloads from
    the gathered shards (with an LM head of its own: the built-in model ties it). The server
    follows every update, rollout 0 draws the samples one process draws through the same
    server, and a chain of kills (rank 1 mid-training, rank 0 after training) resumes to the
    uninterrupted N=2 run in every tensor and metric. No server outlives its run."""
    env = {**fake_vllm, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    n2 = tmp_path / "n2"
    run_uninterrupted(torchrun_vllm_args(tmp_path / "w2"), n2, nproc=2, env=env, timeout=300)
    assert_learned(n2, builtin_model)
    records = read_metrics(n2)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(r["logprob_abs_diff"] < 1e-4 for r in records), records
    assert len(Path(fake_vllm["FAKE_VLLM_RELOADS"]).read_text().splitlines()) == 3
    written = tmp_path / "w2" / "current"
    tensors = load_file(str(written / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert '"tie_word_embeddings": false' in (written / "config.json").read_text()

    n1 = tmp_path / "n1"
    run_uninterrupted(torchrun_vllm_args(tmp_path / "w1"), n1, nproc=1, env=env, timeout=300)
    first = read_metrics(n1)[0]
    for key in ("prompt_indices", "reward_mean", "response_len"):
        assert first[key] == records[0][key], key

    killed = tmp_path / "killed"
    kills = [Kill.at("optimizer_step", 3, rank=1), Kill.at("after_train", rank=0)]
    outcomes = run_with_kills(
        torchrun_vllm_args(tmp_path / "wk"), killed, kills, nproc=2, env=env, timeout=300
    )
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed", "killed"], table
    assert all(o.intact and o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(n2, killed) == []
    assert wait_dead(server_pids(fake_vllm)) == []


LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--lr", "2e-3"]


@pytest.mark.parametrize("runtime_lora", [True, False], ids=["adapter", "no-runtime-lora"])
def test_a_lora_run_syncs_the_adapter_alone_or_merged_weights(
    cli, builtin_model, fake_vllm, tmp_path, runtime_lora
):
    """A launched server gets --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING: the base once,
    then each version of the adapter alone (/v1/load_lora_adapter, the previous one unloaded),
    requested as the `model`. A server that answers 404 there gets merged weights, said once."""
    pytest.importorskip("peft")
    env = fake_vllm if runtime_lora else {**fake_vllm, "FAKE_VLLM_NO_RUNTIME_LORA": "1"}
    save = tmp_path / "run"
    args = builtin_train_args("--rollout-engine", "vllm", "--vllm-python", sys.executable,
                              "--vllm-start-timeout", "120", "--global-batch-size", "16",
                              "--num-rollout", "2", "--precision", "fp32", *LORA)  # fmt: skip
    done = cli("train", *args, "--save", save, env=env)
    assert done.returncode == 0, done.stderr
    records = read_metrics(save)
    assert records[-1]["global_step"] > 0
    assert all(r["logprob_abs_diff"] < 1e-4 for r in records), records
    reloads = Path(fake_vllm["FAKE_VLLM_RELOADS"]).read_text().splitlines()
    full = [line for line in reloads if not line.startswith("/v1/")]
    if runtime_lora:
        assert done.stdout.count("each update sends the adapter alone") == 1, done.stdout
        assert "merged weights" not in done.stdout
        assert len(full) == 1  # the base, at the first sync only
        loads = [line.split()[1] for line in reloads if line.startswith("/v1/load")]
        unloads = [line.split()[1] for line in reloads if line.startswith("/v1/unload")]
        assert len(loads) == 3 and len(set(loads)) == 3 and unloads == loads[:-1], reloads
    else:
        assert done.stdout.count("given merged weights") == 1, done.stdout
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in done.stdout, done.stdout
        assert len(full) == 4  # the base, then merged weights at every sync (the first again)


def test_the_tool_loop_runs_through_vllm_with_token_ids_in_and_out(
    cli, builtin_model, fake_vllm, tmp_path
):
    """Multi-turn with tools on the vLLM engine: every turn's input is the previous ids plus the
    tool's (sent as token ids, never re-tokenized), so the trainer's log-probs of the model's
    own tokens equal the server's and the tool tokens stay out of the loss."""
    tools = Path(__file__).with_name("multiturn_tools.py")
    save = tmp_path / "run"
    args = builtin_train_args(
        "--rollout-engine", "vllm", "--vllm-python", sys.executable,
        "--vllm-start-timeout", "120", "--global-batch-size", "16", "--precision", "fp32",
        "--generate-execute-tool-function-path", f"{tools}:tool",
        "--generate-tool-call-parser", "odd_digit", "--generate-max-turns", "3",
        "--tool-timeout", "1", "--rollout-max-response-len", "4",
    )  # fmt: skip
    done = cli("train", *args, "--num-rollout", "2", "--save", save, env=fake_vllm)
    assert done.returncode == 0, done.stderr
    records = read_metrics(save)
    assert sum(r["rollout/tool_calls"] for r in records) > 0, records
    assert all(r["logprob_abs_diff"] < 1e-4 for r in records), [
        r["logprob_abs_diff"] for r in records
    ]


@pytest.mark.slow
@pytest.mark.parametrize("runtime_lora", [True, False], ids=["adapter", "no-runtime-lora"])
def test_torchrun_n2_lora_syncs_the_gathered_adapter_alone_or_merged_weights(
    builtin_model, fake_vllm, tmp_path, runtime_lora
):
    """LoRA under torchrun through a vLLM server rank 0 launches: rank 0 gathers the base from
    the shards once (with an LM head of its own), then each version of the adapter alone; a
    server without runtime LoRA updating gets the merged weights rank 0 computes from the
    gathered shards, said once. Either way it samples with the trainer's weights."""
    pytest.importorskip("peft")
    env = {**fake_vllm, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if not runtime_lora:
        env["FAKE_VLLM_NO_RUNTIME_LORA"] = "1"
    save = tmp_path / "n2"
    args = [*torchrun_vllm_args(tmp_path / "w"), "--precision", "fp32", *LORA]
    done = run_uninterrupted(args, save, nproc=2, env=env, timeout=300)
    records = read_metrics(save)
    assert records[-1]["global_step"] > 0
    # rollout 1 samples with a trained adapter: a stale, unmerged or wrongly merged sync shows
    assert all(r["logprob_abs_diff"] < 1e-4 for r in records), records
    reloads = Path(fake_vllm["FAKE_VLLM_RELOADS"]).read_text().splitlines()
    full = [line for line in reloads if not line.startswith("/v1/")]
    if runtime_lora:
        assert done.stdout.count("each update sends the adapter alone") == 1, done.stdout
        assert "gathered from the shards" in done.stdout and "merged weights" not in done.stdout
        assert len(full) == 1  # the base, at the first sync only
        loads = [line.split()[1] for line in reloads if line.startswith("/v1/load")]
        assert len(loads) == 3 and len(set(loads)) == 3, reloads
        base = load_file(str(tmp_path / "w" / "current" / "model.safetensors"))
        assert not any("lora" in name or "base_layer" in name for name in base)
        assert torch.equal(base["lm_head.weight"], base["model.embed_tokens.weight"])
    else:
        assert done.stdout.count("given merged weights") == 1, done.stdout
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in done.stdout, done.stdout
        assert len(full) == 4  # the base, then merged weights at every sync (the first again)
