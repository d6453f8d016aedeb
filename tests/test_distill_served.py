"""On-policy distillation with a served teacher (--opd-type sglang): `mileage serve`'s
prefill-only scoring, the client's checks of a reply, and exact resume through the journal
when the process dies, when the teacher server dies, and when it answers otherwise after a
kill.
"""

from __future__ import annotations

import pytest
import torch
from test_algorithms import _long_prompt_batch
from test_distill import by_hand

from mileage.rollout.engines.http import BadReply
from mileage.rollout.teacher import _reply_checker
from mileage.serve.requests import RequestError
from mileage.testing.compare import compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill, crash_run_args
from mileage.testing.servers import start_servers

SERVE = ("--dtype", "float32", "--num-threads", "1")
SAMPLES_PER_ROLLOUT = 8 * 4  # crash_run_args: one scoring request per sample


def test_serve_scores_given_tokens_as_the_model_does(tiny_hf):
    from mileage.serve.server import EngineServer

    server = EngineServer(str(tiny_hf))
    batch = _long_prompt_batch(server.vocab_size)
    expected = by_hand(server.engine.model, batch, 0.7)
    for row in range(len(batch)):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        reply = server.generate(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
                "return_logprob": True,
                "logprob_start_len": 3,
            }
        )
        rows = reply["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in rows] == ids[3:] and reply["output_ids"] == []
        got = torch.tensor([lp for lp, _, _ in rows])
        assert torch.allclose(got, expected[row, 2 : len(ids) - 1], atol=1e-5)
    with pytest.raises(RequestError, match="needs return_logprob true"):
        server.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}})


def test_the_served_teacher_s_scores_land_on_the_response_tokens(tiny_hf, tmp_path):
    """ServedTeacher against `mileage serve`'s handler (no socket): each response token gets
    the teacher's log-prob of it, where the packed batch holds that token; a second call with
    the same samples reads the journal and sends nothing."""
    from mileage.rollout.journal import ToolJournal
    from mileage.rollout.sample import Sample
    from mileage.rollout.teacher import ServedTeacher
    from mileage.serve.server import EngineServer
    from mileage.training.batch import pack_samples, response_values

    server = EngineServer(str(tiny_hf))
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i in range(4):
        prompt = torch.randint(4, server.vocab_size, (5 + i,), generator=gen).tolist()
        response = torch.randint(4, server.vocab_size, (2 + 2 * i,), generator=gen).tolist()
        samples.append(Sample(None, prompt, response, [-1.0] * len(response), "", 0.0, True))
    teacher = ServedTeacher("http://unused", 5.0, 1, ToolJournal(tmp_path / "journal"), 0.7)
    teacher.pool.map = lambda path, payloads, checks: [
        check(server.generate(p)) for p, check in zip(payloads, checks, strict=True)
    ]
    batch = pack_samples(samples, 0)
    got = response_values(batch, samples, teacher.score(samples, slot=3))
    expected = by_hand(server.engine.model, batch, 0.7) * batch.loss_mask
    assert torch.allclose(got, expected, atol=1e-5) and teacher.requests == 4
    fresh = ServedTeacher("http://unused", 5.0, 1, ToolJournal(tmp_path / "journal"), 0.7)
    assert fresh.score(samples, slot=3) == teacher.score(samples, slot=3) and fresh.requests == 0
    other = [
        Sample(None, s.prompt_ids, s.response_ids[::-1], s.logprobs, "", 0.0, True) for s in samples
    ]
    fresh.pool.map = teacher.pool.map
    fresh.score(other, slot=3)  # other tokens under the same keys: asked again
    assert fresh.requests == 4


@pytest.mark.parametrize(
    "reply, says",
    [
        ({"meta_info": {"input_token_logprobs": "garbage"}}, "is not 3 [log-prob"),
        ({"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 9, None], [-1.0, 7, None]]}},
         "is not [log-prob, 6"),
        ({"meta_info": {"input_token_logprobs": [[None, 5, None], [0.5, 6, None], [-1.0, 7, None]]}},
         "holds 0.5, not a log-prob"),
        ({"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None], ["x", 7, None]]}},
         "is not [log-prob, 7"),
        ({"text": "no meta_info"}, "is not 3 [log-prob"),
    ],
)  # fmt: skip
def test_a_reply_that_is_not_one_log_prob_per_asked_token_is_rejected(reply, says):
    check = _reply_checker([1, 4, 5, 6, 7], 2)
    with pytest.raises(BadReply) as caught:
        check(reply)
    assert says in str(caught.value)
    ok = {"meta_info": {"input_token_logprobs": [[-3.0, 5, None], [-1.0, 6, None], [-2.0, 7, "a"]]}}
    assert check(ok) == [-1.0, -2.0] and check([ok]) == [-1.0, -2.0]


@pytest.fixture(scope="module")
def teacher_server(tiny_hf):
    """The teacher: the tiny random model, which shares the built-in tokenizer."""
    (server,) = start_servers(tiny_hf, 1, args=SERVE)
    yield server.url
    server.stop()


def served_args(url: str) -> list[str]:
    return [
        *crash_run_args(num_rollout=3),
        "--use-opd", "--opd-type", "sglang", "--opd-teacher-url", url, "--opd-kl-coef", "0.5",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(teacher_server, builtin_model, tmp_path_factory):
    save = tmp_path_factory.mktemp("opd_served") / "run"
    done = run_uninterrupted(served_args(teacher_server), save)
    assert "(served, SGLang /generate scoring, journaled)" in done.stdout, done.stdout
    assert "teacher kl" in done.stdout
    return save


def test_kills_at_commit_points_resume_to_the_uninterrupted_tensors(
    teacher_server, reference, tmp_path
):
    save = tmp_path / "run"
    chain = [
        Kill.at("optimizer_step", 3),
        Kill.at("save_after_model"),
        Kill.at("commit_after_tracker"),
    ]
    outcomes = run_with_kills(served_args(teacher_server), save, chain)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(chain), table
    for outcome in outcomes:
        assert not outcome.problems and outcome.intact and outcome.resumed, table
    assert compare_runs(reference, save) == [], table


def test_a_teacher_server_that_dies_mid_rollout_stops_the_run_and_a_rerun_is_exact(
    teacher_server, tiny_hf, reference, tmp_path
):
    """The teacher dies at its 40th request (rollout 1): the run stops in one line with rollout
    0 committed; rerun against a healthy teacher, it ends on the uninterrupted tensors."""
    (dying,) = start_servers(tiny_hf, 1, env={"MILEAGE_SERVE_FAULT": "die:40"}, args=SERVE)
    save = tmp_path / "run"
    try:
        stopped = launch([*served_args(dying.url), "--opd-teacher-timeout", "5"], save)
    finally:
        dying.stop()
    assert stopped.returncode == 2, stopped.tail()
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("mileage: error")]
    assert len(errors) == 1 and "the OPD teacher" in errors[0], stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert "rollout 0 |" in stopped.stdout and "rollout 1 |" not in stopped.stdout
    rerun = launch(served_args(teacher_server), save)
    assert rerun.returncode == 0, rerun.tail()
    assert "plan: resume at rollout 1 of 3" in rerun.stdout
    assert compare_runs(reference, save) == []


def test_a_resumed_rollout_reads_the_teacher_from_the_journal(
    teacher_server, tiny_hf, reference, tmp_path
):
    """Killed in the last rollout's training, after its scores were journaled, then rerun
    against a teacher that answers garbage: the rerun never asks it, and ends exact."""
    save = tmp_path / "run"
    last_rollout_step = 2 * 2 + 1  # two optimizer steps per rollout
    kill = {"MILEAGE_KILL_AT": f"optimizer_step:{last_rollout_step}"}
    killed = launch(served_args(teacher_server), save, env=kill)
    assert killed.returncode == -9 and "rollout 1 |" in killed.stdout, killed.tail()
    assert "rollout 2 |" not in killed.stdout
    (garbage,) = start_servers(tiny_hf, 1, env={"MILEAGE_SERVE_FAULT": "garbage:1"}, args=SERVE)
    try:
        rerun = launch(served_args(garbage.url), save)
    finally:
        garbage.stop()
    assert rerun.returncode == 0, rerun.tail()
    assert compare_runs(reference, save) == []


def test_a_teacher_that_answers_garbage_stops_the_run_in_one_line(tiny_hf, builtin_model, tmp_path):
    (garbage,) = start_servers(tiny_hf, 1, env={"MILEAGE_SERVE_FAULT": "garbage:1"}, args=SERVE)
    try:
        done = launch([*served_args(garbage.url), "--opd-teacher-attempts", "2"], tmp_path / "run")
    finally:
        garbage.stop()
    assert done.returncode == 2, done.tail()
    errors = [line for line in done.stderr.splitlines() if line.startswith("mileage: error")]
    assert len(errors) == 1 and "failed after 2 tries" in errors[0], done.stderr
    assert "input_token_logprobs" in errors[0] and "Traceback" not in done.stderr


def test_an_unreachable_teacher_is_refused_before_anything_runs(builtin_model, tmp_path):
    done = launch(served_args("http://127.0.0.1:9"), tmp_path / "run")
    assert done.returncode == 2, done.tail()
    assert "--opd-teacher-url http://127.0.0.1:9: no answer from /get_model_info" in done.stderr
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("iter_*"))
