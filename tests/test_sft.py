"""`mileage sft`: the data's own answers trained by their NLL through the same driver,
checkpoints and resume as RL; what is trained of a conversation; refusals; and the hand-over
of an SFT run to `mileage train`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from mileage.cli.main import main
from mileage.errors import UserError
from mileage.rollout.prompts import Prompt, load_jsonl
from mileage.rollout.rollout import PromptEncoder
from mileage.rollout.sft import sft_sample
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill, crash_run_args

CHAT = (
    "{% for m in messages %}[{{ m.role[0] }}]{{ m.content }}|{% endfor %}"
    "{% if add_generation_prompt %}[a]{% endif %}"
)
SFT_ARGS = [
    "--num-rollout", "4",
    "--rollout-batch-size", "16",
    "--global-batch-size", "8",  # two optimizer steps per rollout, as the crash run
    "--lr", "1e-4",
    "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine",
    "--rollout-shuffle",
    "--eval-interval", "2",
    "--num-threads", "1",
]  # fmt: skip
CHAIN = [
    Kill.at("optimizer_step", 2),
    Kill.at("save_after_model"),
    Kill.at("commit_before_tracker"),
    Kill.at("after_metrics"),
]


@pytest.fixture(scope="module")
def chat_encoder() -> PromptEncoder:
    from mileage.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=>abcdefghijklmnopqrstuvwxyz[]| ")
    tok.chat_template = CHAT
    return PromptEncoder(tok, chat_template=False)


def ids(encoder: PromptEncoder, text: str) -> list[int]:
    return encoder.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_pair_trains_its_response_and_the_end_of_sequence(chat_encoder):
    prompt = Prompt(0, "12+3=", "15")
    sample = sft_sample(prompt, chat_encoder, eos_id=2)
    assert sample.prompt_ids == chat_encoder.prompt_ids(prompt)
    assert sample.response_ids == [*ids(chat_encoder, "15"), 2] and sample.mask() == [1, 1, 1]
    sample.check()


def test_a_conversation_trains_its_assistant_turns_only(chat_encoder):
    turns = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    sample = sft_sample(Prompt(0, "2+2=", "", turns), chat_encoder, eos_id=2)
    assert sample.prompt_ids == ids(chat_encoder, "[u]1+2=|[a]")
    assert sample.response_ids == ids(chat_encoder, "3|[u]2+2=|[a]4|")
    # "3|" and "4|" are trained; the user turn and the role marker before "4" are not
    assert sample.mask() == [1, 1] + [0] * 8 + [0] * 3 + [1, 1]
    sample.check()


def test_records_without_an_answer_are_refused(chat_encoder, tmp_path):
    with pytest.raises(UserError, match="SFT record 3 has no response"):
        sft_sample(Prompt(3, "1+1=", ""), chat_encoder, eos_id=2)
    opening = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "1"}]
    with pytest.raises(UserError, match="starts with an assistant turn"):
        sft_sample(Prompt(4, "1", "", opening), chat_encoder, eos_id=2)
    # a conversation with its answers needs no label column; a bare prompt does
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1"},
                                              {"role": "assistant", "content": "2"}]}) + "\n")  # fmt: skip
    assert load_jsonl(str(data), "messages", "label")[0].label == ""
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1"}]}) + "\n")
    with pytest.raises(UserError, match="missing key 'label'"):
        load_jsonl(str(data), "messages", "label")


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--loss-type", "policy_loss"], "mileage sft trains --loss-type sft_loss"),
        (["--n-samples-per-prompt", "4"], "--n-samples-per-prompt must be 1"),
        (["--dynamic-sampling-filter-path", "mileage.rollout.dynamic:check_nonzero_std"],
         "--dynamic-sampling-filter-path is for `mileage train`"),
        (["--advantage-estimator", "ppo"], "--advantage-estimator ppo is for `mileage train`"),
    ],
)  # fmt: skip
def test_flags_of_sampled_training_are_refused_in_one_line(flags, says, mileage_home, capsys):
    assert main(["sft", "--num-rollout", "1", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def reference(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("sft_reference") / "run"
    done = run_uninterrupted(SFT_ARGS, save, subcommand="sft")
    assert "sft loss" in done.stdout and "ppo_kl" not in done.stdout, done.stdout
    return save


def test_sft_learns_the_task_and_records_its_stage(reference):
    records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert evals[-1] > evals[0] + 0.05, evals  # the built-in task's answers, learned
    assert all(r["sft_tokens"] > 0 for r in records if r["rollout_id"] >= 0)
    meta = json.loads(next(reference.glob("iter_*/meta.json")).read_text())
    assert meta["stage"] == "sft"


def test_plan_sft_plans_the_sft_run(reference, capsys):
    where = ["--save", str(reference), "--load", str(reference)]
    assert main(["plan", "--sft", "--json", *SFT_ARGS, *where]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["stage"] == "sft" and plan["action"] == "complete", plan
    assert main(["plan", *SFT_ARGS, *where]) == 2  # as `mileage train`: RL would not continue it
    err = capsys.readouterr().err
    assert "holds SFT checkpoints: `mileage sft` continues them; to start RL from them" in err


def test_kills_at_commit_points_resume_to_the_uninterrupted_tensors(reference, tmp_path):
    save = tmp_path / "run"
    outcomes = run_with_kills(SFT_ARGS, save, CHAIN, subcommand="sft")
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems and outcome.intact and outcome.resumed, table
    assert compare_runs(reference, save) == [], table


def test_train_starts_rl_from_an_sft_run_and_a_rerun_resumes_its_own_save(reference, tmp_path):
    rl = tmp_path / "rl"
    args = ["train", *crash_run_args(num_rollout=2), "--load", str(reference), "--save", str(rl)]
    first = run_cli(*args, "--debug-exit-after-rollout", "1")
    assert first.returncode == 0, first.stderr
    assert "is an SFT checkpoint: RL starts from its weights with a fresh optimizer" in first.stdout
    assert "plan: fresh start at rollout 0 of 2" in first.stdout
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "plan: resume at rollout 1 of 2" in again.stdout, again.stdout
    assert "holds this RL run's checkpoints, started from the SFT checkpoint" in again.stdout
    meta = json.loads(next(rl.glob("iter_*/meta.json")).read_text())
    assert "stage" not in meta  # an RL checkpoint, as before SFT existed
