"""`--rollout-engine vllm --colocate`: vLLM's `LLM` class in the trainer's process, every weight
update handed over in memory. CI has no vLLM, so these runs use `tests/fake_vllm_inproc` (the
calls mileage makes, answered by mileage's own engine; like vLLM it reseeds and draws from the
process's global generators). The real vLLM 0.32 run equals a disk-synced vLLM server run in
every tensor (docs/engines.md: measured, not run by CI).

It shows: a colocated run samples with the trainer's weights at every rollout (the engine's
log-probs within 1e-5 of the trainer's recompute; in memory after the first load), and killed
mid-sync (half the tensors handed over), after a rollout generated and inside a save, it
resumes to the uninterrupted run's tensors; bad setups stop in one line with exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, assert_learned

from mileage.testing.compare import compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

FAKE = Path(__file__).with_name("fake_vllm_inproc")
ARGS = [
    "--num-rollout", "4",
    "--rollout-batch-size", "8",
    "--n-samples-per-prompt", "4",
    "--global-batch-size", "16",
    "--rollout-shuffle",
    "--eval-interval", "0",
    "--num-threads", "1",
    "--precision", "fp32",
    "--rollout-engine", "vllm",
    "--colocate",
]  # fmt: skip


def env_for(reloads: Path, sleep: bool = False) -> dict[str, str]:
    """The fake vLLM first on the path; the engine's loads and reloads logged to `reloads`;
    `sleep`: vLLM's sleep mode available, as on a CUDA GPU."""
    env = {"PYTHONPATH": f"{FAKE}:{REPO}", "FAKE_VLLM_RELOADS": str(reloads)}
    return {**env, "FAKE_VLLM_SLEEP": "1"} if sleep else env


@pytest.mark.slow
def test_a_colocated_run_syncs_in_memory_and_killed_anywhere_lands_on_the_uninterrupted_run(
    builtin_model, tmp_path
):
    reference = tmp_path / "reference"
    env = env_for(tmp_path / "ref_reloads.txt", sleep=True)
    done = run_uninterrupted(ARGS, reference, env=env)
    assert_learned(reference, builtin_model)
    assert "colocated vLLM 0.32.0+fake in this process (float32); sleep mode" in done.stdout
    assert "--colocate: vLLM runs in this process" in done.stdout  # the plan says so
    reloads = (tmp_path / "ref_reloads.txt").read_text().splitlines()
    # loaded once from the disk, then every update in memory, all tensors (the untied head too);
    # asleep (weights discarded) from each rollout's samples to its update, which wakes the
    # weights, reloads them, then wakes the KV cache
    assert reloads[0].startswith("start ") and len(reloads) == 1 + 4 * 4, reloads
    memory = reloads[3::4]
    assert len(set(memory)) == 1 and memory[0].startswith("memory "), reloads
    assert reloads[1::4] == ["sleep 2"] * 4 and reloads[2::4] == ["wake weights"] * 4, reloads
    assert reloads[4::4] == ["wake kv_cache"] * 4, reloads
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    # the engine sampled with the trainer's weights at every rollout
    assert all(0 <= r["logprob_abs_diff"] < 1e-5 for r in records), records

    chain = [
        Kill.at("mid_weight_sync", 2),  # half of rollout 0's update handed to the engine
        Kill.at("after_generate", 2),  # rollout 1 generated, not trained
        Kill.at("save_after_model", 2),  # inside rollout 1's save
    ]
    save = tmp_path / "run"
    env = env_for(tmp_path / "run_reloads.txt", sleep=True)
    outcomes = run_with_kills(ARGS, save, chain, env=env)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(chain), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table


@pytest.mark.parametrize(
    "extra, env, says, subcommand",
    [
        (["--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9"], {},
         "--colocate runs vLLM inside this process: it needs --rollout-engine vllm", "train"),
        (["--rollout-url", "http://127.0.0.1:9"], {}, "and no --rollout-url", "train"),
        ([], {"PYTHONPATH": str(REPO)}, "`import vllm` fails here", "train"),
        ([], {"FAKE_VLLM_FAIL": "load"}, "--colocate: vLLM could not load the model", "train"),
        ([], {}, "so their draws would interleave in an order no checkpoint can replay",
         "train-async"),
        (["--offload-rollout"], {}, "which vLLM supports on CUDA, ROCm and XPU GPUs only",
         "train"),
    ],
)  # fmt: skip
def test_a_colocated_setup_that_cannot_work_stops_in_one_line(
    builtin_model, tmp_path, extra, env, says, subcommand
):
    args = [*ARGS[:-3], "--num-rollout", "1", "--rollout-engine", "vllm", "--colocate", *extra]
    env = {**env_for(tmp_path / "reloads.txt"), **env}
    done = launch(args, tmp_path / "run", env=env, subcommand=subcommand)
    assert done.returncode == 2, done.tail()
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and says in lines[-1], done.stderr
    assert not (tmp_path / "run" / "latest_checkpointed_iteration.txt").exists()


def test_the_engine_leaves_the_trainer_s_random_states_alone(builtin_model, monkeypatch):
    """vLLM seeds Python's, NumPy's and torch's global generators when it starts and draws from
    them as it samples; those states are the trainer's (its dropout, its checkpoints), so the
    engine puts them back: a run's randomness stays a function of --seed."""
    import random
    import sys

    import numpy as np
    import torch

    from mileage.models.hf import load_causal_lm, load_tokenizer
    from mileage.rollout.engine import SamplingParams
    from mileage.rollout.engines.base import RowSeeds
    from mileage.rollout.engines.colocated import ColocatedVLLM
    from mileage.rollout.engines.config import EngineConfig

    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine sets it to 0
    for name in ("vllm", "vllm.inputs"):  # the fake, imported here, is forgotten afterwards
        monkeypatch.delitem(sys.modules, name, raising=False)
    model, tokenizer = load_causal_lm(builtin_model), load_tokenizer(builtin_model)
    cfg = EngineConfig(rollout_engine="vllm", colocate=True)
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    engine = ColocatedVLLM(
        cfg, model.config.vocab_size, tokenizer.eos_token_id, str(builtin_model), print, "float32"
    )
    try:
        engine.update_weights(model, 0)  # starts the engine
        params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0)
        out = engine.generate([[1, 2, 3]] * 2, params, RowSeeds((7, 8)))
        engine.update_weights(model, 1)  # in memory
    finally:
        engine.close()
        for name in ("vllm", "vllm.inputs"):
            sys.modules.pop(name, None)
    assert all(c.response_ids and c.weight_version == 0 for c in out)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def n2_env(reloads: Path) -> dict[str, str]:
    from conftest import torchrun_env

    return {**torchrun_env(), **env_for(reloads)}


def n2_reference(tmp_path: Path, args: list[str]) -> Path:
    """An N=2 colocated run: every rank's engine loaded once from the disk, then every update
    in memory, and sampling with the trainer's weights at every rollout."""
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference, nproc=2, env=n2_env(tmp_path / "ref_reloads.txt"))
    reloads = (tmp_path / "ref_reloads.txt").read_text().splitlines()
    starts = [line for line in reloads if line.startswith("start ")]
    assert sorted(s.rsplit("/", 1)[-1] for s in starts) == ["rank0", "rank1"], reloads
    memory = [line for line in reloads if line.startswith("memory ")]
    assert len(memory) == 2 * 3 and len(set(memory)) == 1, reloads  # 3 updates after the load
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["logprob_abs_diff"] < 1e-5 for r in records), records
    return reference


N2_ARGS = [*ARGS[:1], "3", *ARGS[2:]]  # 3 rollouts


@pytest.mark.slow
def test_under_torchrun_every_rank_s_engine_takes_the_gathered_weights_in_memory(
    builtin_model, tmp_path
):
    """N=2: vLLM joins the trainer's process group, so each rank runs an engine of its own
    (distributed/colocated.py), sampling its share of the rows with the rows' own seeds; each
    takes the gathered full values, in memory after its first load. Killed mid-sync on rank 0
    (half the tensors handed to its engine) and on rank 1, the run lands on the uninterrupted
    one."""
    rollouts = tmp_path / "rollouts" / "{rollout_id}.json"
    reference = n2_reference(tmp_path, [*N2_ARGS, "--save-debug-rollout-data", rollouts])
    # the first rollout, sampled from the same weights, is the one a single process draws
    one = tmp_path / "one" / "{rollout_id}.json"
    args = [*ARGS, "--num-rollout", "1", "--save-debug-rollout-data", one]
    run_uninterrupted(args, tmp_path / "one_run", env=env_for(tmp_path / "one.txt"))
    tokens = [
        [
            s["response_ids"]
            for s in json.loads(Path(str(f).format(rollout_id=0)).read_text())["samples"]
        ]
        for f in (rollouts, one)
    ]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 32, tokens
    chain = [Kill.at("mid_weight_sync", 2, rank=0), Kill.at("optimizer_step", 3, rank=1)]
    save = tmp_path / "run"
    outcomes = run_with_kills(N2_ARGS, save, chain, nproc=2, env=n2_env(tmp_path / "run.txt"))
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(chain), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table


@pytest.mark.slow
def test_under_torchrun_a_lora_run_s_engines_take_the_merged_weights(builtin_model, tmp_path):
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear"]
    n2_reference(tmp_path, [*N2_ARGS, *lora])


def test_tools_with_colocated_vllm_under_torchrun_are_refused_naming_why(
    builtin_model, tmp_path, monkeypatch, capsys
):
    """Each rank's colocated engine samples its own share, so each rank would run the tools."""
    from mileage.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = [*ARGS, "--num-rollout", "1", "--builtin-task", "addition-tool"]
    assert main(["train", *args, "--save", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "colocated vLLM runs in every rank's process" in line and "would run the tools" in line
    assert not (tmp_path / "run").exists()


def test_offload_rollout_without_colocate_is_refused_naming_why():
    from mileage.errors import UserError
    from mileage.rollout.engines.config import EngineConfig

    cfg = EngineConfig(rollout_engine="vllm", offload_rollout=True)
    with pytest.raises(UserError, match="without --colocate vLLM or SGLang runs in a server"):
        cfg.validate()


def test_vllm_args_with_colocate_take_only_the_gpu_share():
    from mileage.errors import UserError
    from mileage.rollout.engines.colocated import gpu_memory_utilization

    assert gpu_memory_utilization("") == 0.3  # TRL's colocate default
    assert gpu_memory_utilization("--gpu-memory-utilization 0.5") == 0.5
    assert gpu_memory_utilization("--gpu-memory-utilization=0.45") == 0.45
    with pytest.raises(UserError, match="must be in"):
        gpu_memory_utilization("--gpu-memory-utilization 1.5")
    with pytest.raises(UserError, match="only --gpu-memory-utilization applies"):
        gpu_memory_utilization("--max-num-seqs 8")
