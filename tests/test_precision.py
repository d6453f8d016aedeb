"""Precision: `auto` follows the hardware, bf16 computes over fp32 master weights, generation and
the loss share a precision, the checkpoint records it, a resume in bf16 stays bit-exact and a
resume in another precision is announced."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_learned, builtin_train_args
from transformers import AutoModelForCausalLM

from mileage import precision
from mileage.errors import UserError
from mileage.precision import BF16, FP32, autocast, precision_of, resolve, set_precision
from mileage.rollout.engine import LocalEngine, SamplingParams
from mileage.rollout.rollout import Sample
from mileage.training.actor import Actor, AlgoConfig, sequence_logprobs
from mileage.training.batch import pack_samples
from mileage.training.mismatch import (
    MismatchConfig,
    apply_mismatch,
    needs_recompute,
    old_from_first_pass,
    trainer_logprobs,
)
from mileage.training.optimizer import LRSchedule

CPU = torch.device("cpu")

# ------------------------------------------------------------------ auto follows the hardware

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
AVX512_BF16_EPYC = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
AMX_XEON = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [(AVX2_EPYC, FP32), (AVX512_BF16_EPYC, BF16), (AMX_XEON, BF16), ("", FP32)],
    ids=["avx2-only", "avx512-bf16", "amx", "no-cpuinfo"],
)
def test_auto_picks_bf16_only_where_the_cpu_computes_it_natively(
    cpuinfo, expected, tmp_path, monkeypatch
):
    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    real = precision.cpu_flags
    monkeypatch.setattr(precision, "cpu_flags", lambda: real(fake))
    chosen, why = resolve("auto", CPU)
    assert chosen == expected, why
    assert why.startswith("auto: ")
    # an explicit choice is taken as asked, whatever the CPU
    assert resolve("fp32", CPU) == (FP32, "as asked")
    assert resolve("bf16", CPU) == (BF16, "as asked")


def test_cpu_flags_reads_the_flags_line_and_survives_a_missing_file(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(AMX_XEON)
    assert {"amx_bf16", "avx512f"} <= precision.cpu_flags(fake)
    assert precision.cpu_flags(tmp_path / "absent") == set()


def test_bf16_switch_is_precision_bf16_and_contradictions_are_refused():
    assert precision.PrecisionConfig(bf16=True).requested() == BF16
    assert precision.PrecisionConfig().requested() == "auto"
    with pytest.raises(UserError, match="--bf16 and --precision fp32"):
        precision.PrecisionConfig(precision="fp32", bf16=True).requested()


def test_bf16_and_fp32_together_exit_2_with_one_line(cli):
    done = cli("train", "--bf16", "--precision", "fp32", "--num-rollout", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "mileage: error: --bf16 and --precision fp32 contradict each other; give one"
    ]


# ------------------------------------------------- generation and loss share one precision


def _samples(engine: LocalEngine, model, temperature: float = 0.8) -> list[Sample]:
    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12], [1, 13, 14]] * 2
    params = SamplingParams(max_new_tokens=8, temperature=temperature)
    done = engine.generate(prompts, params, torch.Generator().manual_seed(5))
    return [
        Sample(None, c.prompt_ids, c.response_ids, c.logprobs, "", float(i % 2), c.finished)
        for i, c in enumerate(done)
    ]


def test_the_local_engine_generates_in_the_models_precision(tiny_hf):
    """bf16 generation: its log-probs match the bf16 trainer's far closer than the fp32 one's."""
    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf).eval(), BF16)
    samples = _samples(LocalEngine(model, pad_id=0, eos_id=2), model)
    batch = pack_samples(samples, pad_id=0)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        bf16, _ = sequence_logprobs(model, batch, 0.8)
        fp32, _ = sequence_logprobs(set_precision(model, FP32), batch, 0.8)
    engine_vs_bf16 = (batch.old_logprobs[mask] - bf16[mask]).abs().max()
    fp32_vs_bf16 = (fp32[mask] - bf16[mask]).abs().max()
    assert fp32_vs_bf16 > 1e-4  # bf16 really rounds: the two precisions are distinguishable
    assert engine_vs_bf16 < fp32_vs_bf16 / 10, (engine_vs_bf16, fp32_vs_bf16)


def test_autocast_keeps_master_weights_and_gradients_fp32(tiny_hf):
    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf), BF16)
    ids = torch.tensor([[1, 5, 6, 7]])
    with autocast(model):
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def _first_rollout(tiny_hf, mode: str, global_batch: int):
    model = set_precision(AutoModelForCausalLM.from_pretrained(tiny_hf).eval(), mode)
    engine = LocalEngine(model, pad_id=0, eos_id=2)
    batch = pack_samples(_samples(engine, model), pad_id=0)
    algo = AlgoConfig(global_batch_size=global_batch, micro_batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
    actor = Actor(model, opt, LRSchedule(0.0, 0, 0, "constant", 1), algo, 0.8, 2, clip_grad=0)
    return engine, batch, actor


@pytest.mark.parametrize("steps", [1, 2], ids=["one-step", "two-steps"])
@pytest.mark.parametrize("mode", [FP32, BF16])
def test_ppo_ratio_is_exactly_one_at_the_first_step(tiny_hf, mode, steps):
    """The old log-probs of the PPO ratio come from the loss's own precision: in bf16 the
    trainer recomputes them (in-process engine), so the first step's ppo_kl is exactly 0. With
    one optimizer step per rollout the training forward itself gives them: the policy runs
    once per micro-batch, not twice, and the same mismatch is logged."""
    engine, batch, actor = _first_rollout(tiny_hf, mode, global_batch=8 // steps)
    cfg = MismatchConfig()
    assert needs_recompute(cfg, engine, precision_of(actor.model)) == (mode == BF16)
    with torch.no_grad():  # what a recompute gives, for the logged mismatch
        recomputed = trainer_logprobs(actor, batch)
    mask = batch.loss_mask
    expected_diff = float(((recomputed - batch.old_logprobs).abs() * mask).sum() / mask.sum())
    forwards = []
    actor.model.register_forward_hook(lambda *_: forwards.append(1))
    stats = {**apply_mismatch(cfg, engine, actor, batch), **actor.train_rollout(batch)}
    if mode == BF16:
        assert batch.old_from_pass == (steps == 1)
        assert len(forwards) == 2 * (1 if steps == 1 else 2)  # 2 micro-batches (+ recompute)
        assert stats["logprob_abs_diff"] == pytest.approx(expected_diff, rel=1e-3)
        assert expected_diff > 0  # the cached bf16 decode rounds otherwise than the forward
        assert stats["ppo_kl"] == 0.0 and stats["ratio"] == 1.0
        assert stats["clipfrac"] == 0.0
    else:  # fp32: cached decoding and the training forward agree to float rounding
        assert not batch.old_from_pass and len(forwards) == 2
        assert "logprob_abs_diff" not in stats
        assert abs(stats["ppo_kl"]) < 1e-5


def test_old_log_probs_from_the_pass_only_where_nothing_needs_them_before_it(tiny_hf):
    """A KL penalty in the reward, the TIS weights, the mismatch metrics and dropout need the
    old log-probs before the training forward (or without its dropout): those still recompute."""
    _, batch, actor = _first_rollout(tiny_hf, BF16, global_batch=8)
    n = len(batch)
    assert old_from_first_pass(MismatchConfig(), actor, n)
    for flag in ("use_tis", "get_mismatch_metrics", "use_rollout_logprobs"):
        assert not old_from_first_pass(MismatchConfig(**{flag: True}), actor, n), flag
    actor.algo.global_batch_size = 4
    assert not old_from_first_pass(MismatchConfig(), actor, n)
    actor.algo.global_batch_size = 8
    actor.reference, actor.algo.kl_coef = actor.model, 0.1
    assert not old_from_first_pass(MismatchConfig(), actor, n)
    actor.algo.kl_coef = 0.0  # a reference for the KL loss only: the reward is left alone
    assert old_from_first_pass(MismatchConfig(), actor, n)
    actor.dropout_seed = 7
    assert not old_from_first_pass(MismatchConfig(), actor, n)


# --------------------------------------------------------- checkpoints and resume (built-in)


def _meta(save, iteration: int) -> dict:
    return json.loads((save / f"iter_{iteration:07d}" / "meta.json").read_text())


def test_a_checkpoint_records_its_precision_and_another_precision_is_announced(
    cli, builtin_model, tmp_path
):
    save = tmp_path / "run"
    common = ["--save", save, "--load", save]
    first = cli("train", *builtin_train_args("--num-rollout", "2", "--bf16", *common))
    assert first.returncode == 0, first.stderr
    assert (
        "precision: bf16 compute, fp32 master weights (as asked; the engine samples from fp32 "
        "logits)" in first.stdout
    )
    assert _meta(save, 1)["precision"] == BF16
    assert_learned(save, builtin_model)
    # the same precision: no announcement
    again = cli("train", *builtin_train_args("--num-rollout", "3", "--bf16", *common))
    assert again.returncode == 0, again.stderr
    assert "precision changed" not in again.stdout
    # another precision: announced like a world-size change, and the run proceeds
    other = cli("train", *builtin_train_args("--num-rollout", "4", "--precision", "fp32", *common))
    assert other.returncode == 0, other.stderr
    assert "  - precision changed: saved by a bf16 run, resuming in fp32." in other.stdout
    assert "resume at rollout 3 of 4" in other.stdout
    assert _meta(save, 3)["precision"] == FP32


def test_bf16_resume_after_kills_is_bit_exact(builtin_model, tmp_path):
    """The crash harness in bf16: a few kills, then every tensor equals the uninterrupted run's."""
    from mileage.testing.compare import compare_runs
    from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
    from mileage.testing.kills import Kill, crash_run_args

    args = [*crash_run_args(num_rollout=3), "--bf16"]
    reference = tmp_path / "reference"
    run_uninterrupted(args, reference)
    assert_learned(reference, builtin_model)
    assert _meta(reference, 2)["precision"] == BF16
    kills = [
        Kill.at("after_generate"),
        Kill.at("optimizer_step"),
        Kill.at("save_after_optimizer"),
        Kill.at("commit_after_tracker"),
        Kill.at("optimizer_step", 2),
    ]
    save = tmp_path / "killed"
    outcomes = run_with_kills(args, save, kills)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(kills), table
    assert all(o.resumed and not o.problems for o in outcomes), table
    assert compare_runs(reference, save) == [], table
