"""Memory as a budget (`mileage.training.memory`): the estimate's parts, the micro-batch chosen
from it, refusals before anything runs, the choice kept by a resume, and the measured peak in
metrics.jsonl beside the estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mileage.errors import UserError
from mileage.training import memory, memory_use
from mileage.training.memory import (
    GiB,
    Workload,
    choose_micro_batch,
    estimate,
    model_size,
    plan_memory,
)

# SmolLM2-135M's architecture (its config.json), built on the meta device only
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
WORK = Workload(
    samples=64,
    prompt_tokens=62,
    response_tokens=128,
    engine_rows=64,
    bf16=False,
    chunk_tokens=341,
    group=8,
)
PASS = (64 * 190, 64 * 129)  # a plain forward of the whole rollout: tokens, scored positions


def test_model_size_counts_the_real_models_parameters(tiny_hf):
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    config = json.loads((Path(tiny_hf) / "config.json").read_text())
    size = model_size(config)
    assert size.params == sum(p.numel() for p in model.parameters())
    assert size.trainable == size.params
    assert size.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert size.vocab == model.config.vocab_size


def test_lora_trainable_count_is_the_adapters(tiny_hf):
    from mileage.models.lora import LoraConfig, adapter_tensors, apply_lora

    config = json.loads((Path(tiny_hf) / "config.json").read_text())
    cfg = LoraConfig(lora_rank=4, target_modules="q_proj,v_proj")
    peft_model, _ = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_hf), cfg, seed=0)
    adapter = sum(t.numel() for t in adapter_tensors(peft_model).values())
    assert model_size(config, 4, "q_proj,v_proj").trainable == adapter


def test_smollm2_estimate_parts():
    size = model_size(SMOLLM2)
    assert size.params == 134_515_008  # the published count (tied head)
    whole = estimate(size, replace(WORK, chunk_tokens=-1), *PASS)
    parts = whole.parts
    assert parts["weights"] == parts["gradients"] == size.params * 4
    assert parts["optimizer"] == 2 * parts["weights"]
    # 12 x 576 + 5 x 1536 fp32 values per layer and token, over 30 layers: 1.68 MiB a token
    assert whole.per_token == 30 * (12 * 576 + 5 * 1536) * 4
    assert parts["activations"] == 64 * 190 * whole.per_token
    assert parts["logits"] == 64 * 129 * 49152 * 4 * memory.LOGIT_COPIES
    chunked = estimate(size, WORK, *PASS)
    assert chunked.parts["logits"] == 341 * 49152 * 4 * memory.LOGIT_COPIES
    assert chunked.peak < whole.peak
    bf16 = estimate(size, replace(WORK, bf16=True), *PASS)
    assert bf16.parts["activations"] < chunked.parts["activations"]
    assert bf16.parts["engine"] < chunked.parts["engine"]  # no reordered fp32 weights


def test_ranks_shard_the_state_and_gather_one_layer():
    size = model_size(SMOLLM2)
    one = estimate(size, WORK, 1000, 500)
    two = estimate(size, replace(WORK, world_size=2), 1000, 500)
    assert two.parts["weights"] == size.params * 4 // 2 + size.layer_params * 4
    assert two.parts["optimizer"] == one.parts["optimizer"] // 2


def test_train_async_holds_generation_and_training_at_once():
    size = model_size(SMOLLM2)
    apart = estimate(size, WORK, 1000, 500)
    together = estimate(size, replace(WORK, overlapped=True), 1000, 500)
    assert together.peak - apart.peak == min(
        apart.parts["engine"],
        apart.parts["gradients"] + apart.parts["activations"] + apart.parts["logits"],
    )


def test_the_chosen_micro_batch_bounds_activations_by_the_model_state():
    size = model_size(SMOLLM2)
    micro = choose_micro_batch(size, WORK, available=64 * GiB)
    assert 1 < micro < 64 and 64 % micro == 0  # cuts the global batch evenly
    chosen = estimate(size, WORK, *WORK.pass_of(micro))
    state = sum(chosen.parts[k] for k in ("weights", "gradients", "optimizer"))
    assert chosen.parts["activations"] + chosen.parts["logits"] <= state
    fits = [
        m
        for m in (1, 2, 4, 8, 16, 32, 64)
        if sum(estimate(size, WORK, *WORK.pass_of(m)).parts[k] for k in ("activations", "logits"))
        <= state
    ]
    assert micro == max(fits)
    assert chosen.peak <= 6 * GiB  # issue 40's target workload
    # less free memory: a smaller micro-batch
    assert choose_micro_batch(size, WORK, available=3 * GiB + GiB // 2) < micro


def test_a_small_models_whole_batch_stays_one_pass(tiny_hf):
    config = json.loads((Path(tiny_hf) / "config.json").read_text())
    work = replace(WORK, prompt_tokens=8, response_tokens=12, samples=128)
    assert choose_micro_batch(model_size(config), work, available=16 * GiB) == 128


def test_an_explicit_micro_batch_that_cannot_fit_is_refused_naming_what_fits():
    size = model_size(SMOLLM2)
    with pytest.raises(UserError) as refused:
        plan_memory(size, WORK, given=64, saved=None, available=8 * GiB)
    line = str(refused.value)
    assert (
        line.startswith("--micro-batch-size 64 needs ~") and "more than the 8.00 GiB free" in line
    )
    fits = int(line.rsplit("--micro-batch-size ", 1)[1].split()[0])
    assert 64 % fits == 0  # mileage's micro-batches divide the global batch
    assert memory._peak(size, WORK, fits) <= 8 * GiB < memory._peak(size, WORK, 2 * fits)
    assert plan_memory(size, WORK, given=fits, saved=None, available=8 * GiB).micro_batch == fits


def test_a_resume_keeps_the_saved_micro_batch_and_refuses_if_it_no_longer_fits():
    size = model_size(SMOLLM2)
    kept = plan_memory(size, WORK, given=None, saved=16, available=64 * GiB)
    assert (kept.micro_batch, kept.how) == (16, "saved")
    with pytest.raises(UserError, match="chose micro-batches of 16 samples at its start"):
        plan_memory(size, WORK, given=None, saved=16, available=4 * GiB)
    given = plan_memory(size, WORK, given=2, saved=16, available=4 * GiB)
    assert (given.micro_batch, given.how) == (2, "given")


def test_a_shared_prompt_runs_once_per_group_in_a_pass():
    assert WORK.pass_of(8) == (62 + 8 * 129, 8 * 129)
    assert WORK.pass_of(4) == (2 * 62 + 4 * 129, 4 * 129)  # may straddle two prompts
    assert replace(WORK, shared_prompts=False).pass_of(8) == (8 * 190, 8 * 129)


def test_nothing_fits_names_what_to_change():
    with pytest.raises(UserError, match="not even one sample fits: lower --rollout-max-resp"):
        plan_memory(model_size(SMOLLM2), WORK, given=None, saved=None, available=GiB)


def test_peak_is_reset_per_rollout_and_recorded_with_the_estimate():
    memory_use.reset_peak(torch.device("cpu"))
    before = memory_use.peak_record(torch.device("cpu"), 2 * GiB)
    held = bytearray(300 << 20)
    held[::4096] = b"x" * len(held[::4096])  # touch every page
    during = memory_use.peak_record(torch.device("cpu"), None)
    del held
    memory_use.reset_peak(torch.device("cpu"))
    after = memory_use.peak_record(torch.device("cpu"), None)
    assert before["mem_estimate_gib"] == 2.0 and "mem_estimate_gib" not in during
    assert during["mem_peak_gib"] - before["mem_peak_gib"] > 0.25
    assert after["mem_peak_gib"] < during["mem_peak_gib"] - 0.25  # the reset forgot it


def _big_model_dir(tmp_path: Path, tiny_hf: Path) -> Path:
    """An HF directory whose config is a 300M-parameter Llama (tokenizer of the tiny one, an
    empty weight file): the plan needs only its config."""
    from safetensors.torch import save_file

    out = tmp_path / "big"
    out.mkdir()
    for file in Path(tiny_hf).iterdir():
        if file.suffix != ".safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config.update(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
    )
    (out / "config.json").write_text(json.dumps(config))
    save_file({"unused": torch.zeros(1)}, str(out / "model.safetensors"))
    return out


def test_cli_refuses_an_infeasible_micro_batch_before_generating(tmp_path, tiny_hf):
    model = _big_model_dir(tmp_path, tiny_hf)
    save = tmp_path / "run"
    args = [
        sys.executable, "-m", "mileage", "train", "--hf-checkpoint", str(model),
        "--builtin-task", "addition", "--save", str(save), "--num-rollout", "1",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "2048", "--micro-batch-size", "64",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "--micro-batch-size 64 needs ~" in last and "GiB free" in last and "fits" in last
    assert "Traceback" not in done.stderr
    assert not (save / "metrics.jsonl").exists()  # nothing generated, nothing written


def test_plan_json_carries_the_estimate(tmp_path):
    args = [sys.executable, "-m", "mileage", "plan", "--json", "--save", str(tmp_path / "r")]
    done = subprocess.run(
        [*args, "--gradient-checkpointing"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout[done.stdout.index("{") :])
    mem = plan["memory"]
    assert mem["activation_checkpointing"] is True  # the flag reaches the estimate
    assert plan["micro_batch"] == mem["micro_batch"] and mem["micro_batch_from"] == "chosen"
    parts = mem["parts"]
    assert mem["peak"] >= parts["runtime"] + parts["weights"] + parts["optimizer"]
    assert mem["available"] > 0 and mem["peak"] < mem["available"]


def test_a_resume_plans_the_micro_batch_its_checkpoint_records(tmp_path):
    """The micro-batch a run started with wins over what the machine would choose now (resumes
    stay bit-exact); an explicit flag wins over both."""
    from mileage.cli.main import build_parser
    from mileage.preflight import preflight
    from mileage.run_config import RunConfig

    def parse_train_args(flags: list[str]) -> RunConfig:
        return RunConfig.from_args(build_parser().parse_args(["train", *flags]))

    save = tmp_path / "run"
    args = [sys.executable, "-m", "mileage", "train", "--save", str(save), "--num-rollout", "1"]
    args += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--eval-interval", "0"]
    # the built-in model's whole batch (16) would be chosen: the run starts with 4 instead
    done = subprocess.run([*args, "--micro-batch-size", "4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads((save / "iter_0000000" / "meta.json").read_text())["micro_batch_size"] == 4
    fresh = preflight(
        parse_train_args(
            [
                "--save",
                str(tmp_path / "other"),
                "--num-rollout",
                "1",
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "4",
            ]
        )
    )
    assert fresh.plan.micro_batch == 16  # what a fresh start here chooses
    flags = ["--save", str(save), "--load", str(save), "--num-rollout", "2"]
    flags += ["--rollout-batch-size", "4"]
    flags += ["--n-samples-per-prompt", "4", "--eval-interval", "0"]
    plan = preflight(parse_train_args(flags)).plan
    assert plan.action == "resume" and plan.micro_batch == 4
    assert "micro-batch 4 samples (as the run chose at its start" in plan.memory_line
    given = preflight(parse_train_args([*flags, "--micro-batch-size", "8"])).plan
    assert given.micro_batch == 8 and "(--micro-batch-size)" in given.memory_line


def test_the_estimate_counts_checkpointed_layers():
    from dataclasses import replace

    size = model_size(SMOLLM2)
    kept = estimate(size, WORK, *PASS)
    checkpointed = estimate(size, replace(WORK, activation_checkpointing=True), *PASS)
    # what the peak grows by per token and layer checkpointed: 10 hidden-sized values (measured)
    assert checkpointed.per_token == 30 * 10 * 576 * 4
    assert checkpointed.parts["activations"] < 0.5 * kept.parts["activations"]
    assert checkpointed.parts["weights"] == kept.parts["weights"]
