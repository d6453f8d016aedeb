"""LoRA under torchrun (N=2, FSDP2) through a `mileage serve --enable-lora` server: rank 0
gathers the adapter from the shards (the base once per launch) and sends it alone, through the
disk or inside the request (--lora-sync-from-tensor).

The run also has a user's rollout function and a critic (PPO). It shows: the run learns and the server samples with the trainer's weights at every rollout
(log-probs to float rounding); the adapter the server holds at the end is the trainer's final
adapter bit for bit; rollout 0 draws the samples one process draws through the same server; and
a run synced by tensors, killed on either rank (also after the server got an adapter no
checkpoint holds), resumes to the disk-synced uninterrupted run in every tensor.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import torchrun_env

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.tensors import MODEL_DIR, load_tensors
from mileage.metrics import TIMING_KEYS, read_metrics
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import PPO_CRITIC_ARGS, Kill

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

NPROC = 2
ARGS = [
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "8",
    "--rollout-max-response-len", "4",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--precision", "fp32",
    "--lora-rank", "8",
    "--lora-alpha", "16",
    "--target-modules", "all-linear",
    "--lr", "5e-3",
    "--rollout-engine", "sglang",
    "--rollout-timeout", "30",
    "--rollout-sync-timeout", "60",
    # a user's rollout function (it filters groups and draws further prompts; rank 0 runs it)
    # and a critic (PPO with GAE, a critic-only rollout first): composition row 26
    "--rollout-function-path", f"{Path(__file__).with_name('user_rollout.py')}:rollout",
    *PPO_CRITIC_ARGS,
]  # fmt: skip


def args_for(url: str, num_rollout: int, *extra: str) -> list[str]:
    return [*ARGS, "--rollout-url", url, "--num-rollout", str(num_rollout), *extra]


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as reply:
        return json.loads(reply.read())


def stripped(save: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(save)]


@pytest.fixture(scope="module")
def server(builtin_model):
    from mileage.testing.servers import start_servers

    (started,) = start_servers(builtin_model, 1, args=("--dtype", "float32", "--enable-lora"))
    yield started.url
    started.stop()


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory):
    """The uninterrupted N=2 run, the adapter synced through the disk (a directory kept)."""
    root = tmp_path_factory.mktemp("lora_remote_n2")
    save, weights = root / "run", root / "weights"
    args = args_for(server, 3, "--rollout-weights-dir", str(weights))
    done = run_uninterrupted(args, save, nproc=NPROC, env=torchrun_env(), timeout=600)
    return save, weights, done


def test_n2_lora_sends_the_adapter_alone_and_the_server_holds_the_trainers_adapter(
    reference, server
):
    from safetensors.torch import load_file

    save, weights, done = reference
    assert done.stdout.count("each update sends the adapter alone") == 1, done.stdout
    assert "gathered from the shards" in done.stdout and "merged weights" not in done.stdout
    records = read_metrics(save)
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    # every rollout sampled with the weights the trainer had (rollouts 1, 2: a trained adapter)
    assert all(0 <= r["logprob_abs_diff"] < 1e-5 for r in records), records
    info = get(server, "/get_model_info")
    assert info["weight_version"] == str(records[-1]["global_step"])
    assert Path(info["model_path"]) == weights / "current"  # the base, loaded once

    # the last adapter the server loaded is the final checkpoint's, bit for bit (and trained)
    (served,) = [p for p in (weights / "adapters").iterdir() if not p.name.startswith(".")]
    assert served.name == f"mileage-lora-v{info['weight_version']}"
    sent = load_file(str(served / "adapter_model.safetensors"))
    final = load_tensors(checkpoint_path(save, read_tracker(save).iteration) / MODEL_DIR)
    as_saved = {
        "base_model.model." + name.replace(".default.", "."): value for name, value in final.items()
    }
    assert sent.keys() == as_saved.keys()
    assert all(torch.equal(sent[n], as_saved[n]) for n in sent)
    assert any(n.endswith("lora_B.weight") and v.abs().sum() > 0 for n, v in sent.items())
    config = json.loads((served / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["inference_mode"] is True


def test_n2_lora_draws_the_samples_of_one_process(reference, server, tmp_path):
    single = tmp_path / "n1"
    run_uninterrupted(args_for(server, 1), single, timeout=600)
    (one,) = read_metrics(single)
    first = read_metrics(reference[0])[0]
    for key in ("prompt_indices", "reward_mean", "accuracy", "response_len"):
        assert first[key] == one[key], key


def test_n2_lora_by_tensor_killed_on_either_rank_resumes_to_the_disk_synced_run(
    reference, server, tmp_path
):
    save = reference[0]
    kills = [
        Kill.at("optimizer_step", rank=1),
        Kill.at("after_train", 2, rank=0),  # the server holds rollout 1's adapter, no checkpoint
    ]
    killed = tmp_path / "killed"
    args = args_for(server, 3, "--lora-sync-from-tensor")
    outcomes = run_with_kills(
        args, killed, kills, max_reruns=2, nproc=NPROC, env=torchrun_env(), timeout=600
    )
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(save, killed) == [], table
    assert stripped(save) == stripped(killed)
