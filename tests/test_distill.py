"""On-policy distillation (--use-opd) with a teacher in the trainer.

The teacher's term is checked against log-probs computed here by hand; the flags' refusals
each give one line before anything loads; and one OPD run on the built-in model, with the
crash harness's run as its (native) teacher, is the reference for a chain of kills at commit
points and for a damaged teacher checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import builtin_train_args, tiny_llama_dir
from test_algorithms import _long_prompt_batch

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.cli.main import main
from mileage.testing.compare import compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill, crash_run_args
from mileage.training.distill import distill_advantages
from mileage.training.optimizer import LRSchedule
from mileage.training.packing import Batching

CHAIN = [
    Kill.at("optimizer_step"),
    Kill.at("save_after_model"),
    Kill.at("commit_before_tracker"),
    Kill.at("commit_after_tracker"),
]


def opd_flags(teacher: Path, *extra: str) -> list[str]:
    return ["--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", str(teacher), *extra]


def by_hand(model, batch, temperature: float) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) of every position, from one plain forward (target space)."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


def test_the_teacher_term_is_the_sampled_reverse_kl_per_response_token(tiny_hf):
    from transformers import AutoModelForCausalLM

    from mileage.training.actor import Actor, AlgoConfig

    student = AutoModelForCausalLM.from_pretrained(tiny_hf)
    torch.manual_seed(1)
    teacher = type(student)(student.config).eval()  # another random init
    algo = AlgoConfig(micro_batch_size=2)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    schedule = LRSchedule(0.0, 0, 0, "constant", 1)
    batch = _long_prompt_batch(student.config.vocab_size)
    batch.old_logprobs = by_hand(student, batch, 0.8) * batch.loss_mask
    plain = Actor(student, opt, schedule, algo, 0.8, 2, 0)
    plain.prepare(batch, Batching(2))
    base = batch.advantages.clone()
    actor = Actor(student, opt, schedule, algo, 0.8, 2, 0, teacher=teacher, opd_kl_coef=0.5)
    actor.prepare(batch, Batching(2))
    mask = batch.loss_mask
    expected = base - 0.5 * (batch.old_logprobs - by_hand(teacher, batch, 0.8)) * mask
    assert torch.allclose(batch.advantages, expected, atol=1e-5)
    assert not torch.allclose(batch.advantages, base)  # the teacher term acted
    assert torch.equal(batch.advantages[mask == 0], base[mask == 0])  # prompt and padding: none
    # the student as its own teacher: nothing to learn from it
    self_taught = Actor(student, opt, schedule, algo, 0.8, 2, 0, teacher=student, opd_kl_coef=0.5)
    self_taught.prepare(batch, Batching(2))
    assert torch.allclose(batch.advantages, base, atol=1e-5)
    assert abs(self_taught.opd_reverse_kl) < 1e-5


def test_distill_advantages_by_hand():
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    student = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0]])
    teacher = torch.tensor([[-0.5, -3.0, -9.0], [-0.5, -1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out, mean = distill_advantages(adv, student, teacher, mask, 2.0)
    assert torch.equal(out, torch.tensor([[2.0, -1.0, 0.0], [-1.0, -3.0, 3.0]]))
    assert mean == pytest.approx((-0.5 + 1.0 + 0.0 + 1.0 - 2.0) / 5)


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--opd-type", "fsdp"], "--opd-type given without --use-opd"),
        (["--use-opd"], "--use-opd needs --opd-type"),
        (["--use-opd", "--opd-type", "megatron"], "mileage trains with torch FSDP2, not Megatron"),
        (["--use-opd", "--opd-type", "fsdp"], "--opd-type fsdp needs --opd-teacher-load DIR"),
        (
            ["--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", "/nonexistent/teacher"],
            "--opd-teacher-load /nonexistent/teacher does not exist",
        ),
    ],
)
def test_flag_refusals_are_one_line(flags, line, mileage_home, capsys):
    assert main(["plan", *builtin_train_args(*flags)]) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and len(err.splitlines()) == 1, err


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, mileage_home, capsys):
    other = tiny_llama_dir(tmp_path / "other", alphabet="abcdefghij=+ ")
    assert main(["plan", *builtin_train_args(*opd_flags(other))]) == 2
    err = capsys.readouterr().err.strip()
    assert "has another tokenizer" in err and str(other) in err and "than the student" in err
    assert len(err.splitlines()) == 1, err


def test_an_hf_teacher_of_another_size_is_planned_and_counted(tiny_hf, mileage_home, capsys):
    """tiny_hf shares the built-in tokenizer but not its architecture: a valid HF teacher."""
    assert main(["plan", "--json", *builtin_train_args(*opd_flags(tiny_hf))]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["teacher_from"] == str(tiny_hf) and plan["teacher_format"] == "hf"
    assert plan["memory"]["parts"]["teacher"] > 0
    assert main(["plan", *builtin_train_args()]) == 0
    assert "teacher" not in capsys.readouterr().out


def test_a_native_teacher_of_another_architecture_is_refused(
    tiny_hf, mileage_home, tmp_path, capsys
):
    run = tmp_path / "tiny_run"
    done = launch(["--hf-checkpoint", str(tiny_hf), *builtin_train_args("--num-rollout", "1")], run)
    assert done.returncode == 0, done.tail()
    assert main(["plan", *builtin_train_args(*opd_flags(run))]) == 2
    err = capsys.readouterr().err.strip()
    assert "another architecture than the student's" in err and "export-hf" in err, err


@pytest.fixture(scope="module")
def teacher(crash_reference) -> Path:
    return crash_reference[0]


@pytest.fixture(scope="module")
def opd_args(teacher) -> list[str]:
    return [*crash_run_args(num_rollout=4), *opd_flags(teacher, "--opd-kl-coef", "0.5")]


@pytest.fixture(scope="module")
def reference(opd_args, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("opd_reference") / "run"
    done = run_uninterrupted(opd_args, save)
    assert "teacher: " in done.stdout and "teacher kl" in done.stdout, done.stdout
    return save


def test_an_opd_run_logs_the_teacher_kl_and_records_the_teacher(reference, teacher):
    records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    kls = [r["opd_reverse_kl"] for r in records if r["rollout_id"] >= 0]
    assert len(kls) == 4 and all(abs(k) > 1e-4 for k in kls), kls
    meta = json.loads((checkpoint_path(reference, 3) / "meta.json").read_text())
    assert meta["settings"]["--opd-teacher-load"] == str(teacher)
    assert meta["settings"]["--opd-kl-coef"] == 0.5


def test_kills_at_commit_points_resume_to_the_uninterrupted_tensors(opd_args, reference, tmp_path):
    save = tmp_path / "run"
    outcomes = run_with_kills(opd_args, save, CHAIN)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems and outcome.intact and outcome.resumed, table
    assert compare_runs(reference, save) == [], table


def test_a_damaged_teacher_is_refused_before_anything_loads(opd_args, teacher, tmp_path):
    damaged = tmp_path / "teacher"
    shutil.copytree(teacher, damaged)
    iteration = read_tracker(damaged).iteration
    weights = sorted((checkpoint_path(damaged, iteration) / "model").glob("*.distcp"))[0]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    args = [a if a != str(teacher) else str(damaged) for a in opd_args]
    save = tmp_path / "run"
    done = launch(args, save)
    assert done.returncode == 2, done.tail()
    assert "Traceback" not in done.stderr and weights.name in done.stderr, done.stderr
    assert "choose another with --opd-teacher-ckpt-step" in done.stderr
    assert not save.exists() or not list(save.glob("iter_*"))
