"""train-async's parts: the schedule, the rollout buffer, the admission rule, the decoupled PPO
loss against a hand computation, and the bad input it refuses (one line, exit 2)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mileage.async_config import AsyncConfig
from mileage.rollout.buffer import RolloutBuffer, split_groups
from mileage.rollout.prompts import Prompt
from mileage.rollout.rollout import Sample, inadmissible, load_samples
from mileage.training.losses import ppo_clip_loss
from mileage.training.offpolicy import decoupled_weights


def sample(index: int, version: int, logprob: float = -0.1) -> Sample:
    return Sample(
        Prompt(index, f"p{index}", "1"),
        [1, 2],
        [3, 4],
        [logprob, logprob / 3],
        "ab",
        0.5,
        True,
        version,
        [version, version],
    )


def test_one_step_off_generates_each_rollout_with_the_weights_before_the_previous_update():
    cfg = AsyncConfig()
    assert cfg.lead(8) == 1 and cfg.corrects(8)
    # slot p is generated with E(max(0, p - 1)): submitted while the engine holds that version
    versions = [cfg.engine_rollouts(max(0, p - cfg.lead(8))) for p in range(5)]
    assert versions == [0, 0, 1, 2, 3]
    assert [cfg.last_slot_of_version(e, 8) for e in range(3)] == [1, 2, 3]


def test_fully_async_lead_is_the_staleness_bound_within_the_buffer_capacity():
    assert AsyncConfig(fully_async=True, max_weight_staleness=0).lead(8) == 0
    assert not AsyncConfig(fully_async=True, max_weight_staleness=0).corrects(8)
    assert AsyncConfig(fully_async=True, max_weight_staleness=5).lead(8) == 2  # factor 2.0
    assert AsyncConfig(fully_async=True).lead(8) == 2
    interval = AsyncConfig(fully_async=True, max_weight_staleness=0, update_weights_interval=3)
    assert [interval.engine_rollouts(t) for t in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    assert interval.corrects(8)


def test_admission_rule_refuses_future_and_too_old_versions():
    assert inadmissible([3, 3], 3, 0) is None
    assert inadmissible([2], 3, 0) == 2
    assert inadmissible([4], 3, None) == 4
    assert inadmissible([1, 2], 3, 1) == 1
    assert inadmissible([None, 0], 9, None) is None


def test_buffer_takes_in_submission_order_and_round_trips_exactly_through_json():
    buffer = RolloutBuffer()
    odd = -0.1 / 3.0  # a float whose repr must round-trip
    buffer.groups.extend(split_groups(0, 0, [sample(i // 2, 0, odd) for i in range(4)], 2))
    buffer.groups.extend(split_groups(1, 1, [sample(10 + i // 2, 2) for i in range(4)], 2))
    buffer.next_slot = 2
    restored = RolloutBuffer()
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert restored.state_dict() == buffer.state_dict()
    assert restored.groups[0].samples[0].logprobs[0] == odd
    taken, stale = restored.take(3, trained=1, max_staleness=None, handler="drop")
    assert [g.prompt.index for g in taken] == [0, 1, 10] and stale == []
    assert [g.slot for g in restored.groups] == [1]


@pytest.mark.parametrize("handler", ["drop", "retry"])
def test_groups_staler_than_the_bound_are_dropped_or_retried(handler):
    buffer = RolloutBuffer()
    buffer.groups.extend(split_groups(0, 0, [sample(i // 2, 0) for i in range(4)], 2))
    buffer.groups.extend(split_groups(1, 2, [sample(10 + i // 2, 4) for i in range(4)], 2))
    taken, stale = buffer.take(2, trained=2, max_staleness=1, handler=handler)
    assert [g.prompt.index for g in taken] == [10, 11]
    assert [g.prompt.index for g in stale] == [0, 1] and buffer.dropped == 2
    owed = [p.index for p in buffer.draw_retries(8)]
    assert owed == ([0, 1] if handler == "retry" else [])


def test_rollout_files_without_weight_versions_still_load(tmp_path):
    record = {
        "prompt": {"index": 0, "text": "p", "label": "1"},
        "prompt_ids": [1],
        "response_ids": [3],
        "logprobs": [-0.5],
        "response": "a",
        "reward": 1.0,
        "finished": True,
    }
    (tmp_path / "r0.json").write_text(json.dumps({"rollout_id": 0, "samples": [record]}))
    (loaded,) = load_samples(str(tmp_path / "r{rollout_id}.json"), 0, [Prompt(0, "p", "1")], 1)
    assert loaded.weight_versions is None and loaded.oldest_version() is None


def test_decoupled_loss_matches_a_hand_computation_with_the_clip_binding():
    # one row, three response tokens: behaviour (engine, old weights), proximal (trainer before
    # the update), current policy; eps 0.2, cap 2.0
    behaviour = torch.log(torch.tensor([[0.5, 0.2, 0.4]]))
    proximal = torch.log(torch.tensor([[0.6, 0.5, 0.4]]))
    current = torch.log(torch.tensor([[0.9, 0.45, 0.3]]))
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    weights, stats = decoupled_weights(proximal, behaviour, mask, cap=2.0)
    # w = prox / behav: 1.2, 2.5 (> cap: left out), 1.0
    assert torch.allclose(weights, torch.tensor([[1.2, 0.0, 1.0]]))
    assert stats["behav_imp_weight_capped_frac"] == pytest.approx(1 / 3)
    per_token, clip = ppo_clip_loss(
        current, proximal, advantages, mask, 0.2, 0.2, None, False, weights
    )
    # token 0: r = 0.9/0.6 = 1.5, A = 1 -> clipped at 1.2: max(-1.5, -1.2) = -1.2, times w 1.2
    # token 1: weight 0
    # token 2: r = 0.3/0.4 = 0.75, A = 2 -> max(-1.5, -2 * 0.8 = -1.6) = -1.5, times w 1.0
    expected = torch.tensor([[-1.2 * 1.2, 0.0, -1.5]])
    assert torch.allclose(per_token, expected, atol=1e-6)
    assert clip["clipfrac"].tolist() == [[1.0, 0.0, 0.0]]  # the clip binds on token 0
    assert math.isclose(float(per_token.sum()), -2.94, rel_tol=1e-6)


BAD = [
    (["--max-weight-staleness", "1"], "--max-weight-staleness only applies with --fully-async"),
    (["--off-policy-correction", "none"], "--off-policy-correction none with samples"),
    (["--load-debug-rollout-data", "/tmp/x{rollout_id}"], "--load-debug-rollout-data replays"),
    (["--fully-async", "--async-max-concurrent-samples", "5"], "must be a positive multiple"),
    (["--use-tis"], "--off-policy-correction does"),
    (["--keep-old-actor", "--off-policy-correction", "tis"], "--keep-old-actor is itself"),
    (["--keep-old-actor", "--use-rollout-logprobs"], "which --keep-old-actor recomputes"),
    # dynamic sampling composes with train-async through its filter; these name their reason
    (["--partial-rollout", "--keep-old-actor"], "one answer's tokens come from several weight"),
    (
        ["--partial-rollout", "--mask-offpolicy-in-partial-rollout"],
        "train-async trains tokens of older weights by design",
    ),
    (["--over-sampling-batch-size", "8"], "makes up the groups its --dynamic-sampling-filter"),
    (
        ["--buffer-filter-path", "f.py:f", "--dynamic-sampling-filter-path", "f.py:g"],
        "in submission order",
    ),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_async_input_is_one_line_and_exit_2(cli, tmp_path, extra, message):
    done = cli("train-async", "--num-rollout", "1", "--save", tmp_path / "s", *extra)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "s").exists()


def test_staleness_flags_belong_to_train_async_only(cli):
    done = cli("train", "--fully-async")
    assert done.returncode == 2 and "unrecognized arguments: --fully-async" in done.stderr


def test_the_driver_clips_against_the_proximal_policy_and_weights_by_proximal_over_behaviour(
    tiny_hf,
):
    from types import SimpleNamespace

    from mileage.models.hf import load_causal_lm
    from mileage.sources.ahead import correct_off_policy
    from mileage.training.algo import AlgoConfig
    from mileage.training.batch import pack_samples
    from mileage.training.mismatch import MismatchConfig

    model = load_causal_lm(tiny_hf)
    behaviour = [[-0.1, -9.0], [-2.0, -0.05]]  # the engine's (older weights') log-probs
    samples = [
        Sample(Prompt(i, "p", "1"), [1, 5, 6], [7, 8], lp, "x", 1.0, True, 0, [0, 0])
        for i, lp in enumerate(behaviour)
    ]
    batch = pack_samples(samples, pad_id=0)
    actor = SimpleNamespace(algo=AlgoConfig(), model=model, temperature=1.0, chunk_tokens=-1)
    cfg = SimpleNamespace(asynchronous=AsyncConfig(), mismatch=MismatchConfig())
    run = SimpleNamespace(cfg=cfg, actor=actor, engine=None)
    stats = correct_off_policy(run, batch)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[:, :-1]
        proximal = torch.log_softmax(logits.float(), -1).gather(-1, batch.targets[..., None])[
            ..., 0
        ]
    mask = batch.loss_mask
    assert torch.allclose(batch.old_logprobs, proximal * mask, atol=1e-5)
    raw = torch.exp(proximal - pack_samples(samples, 0).old_logprobs) * mask
    expected = torch.where(raw <= 5.0, raw, torch.zeros_like(raw))
    assert torch.allclose(batch.tis_weights, expected, atol=1e-5)
    assert 0.0 < stats["behav_imp_weight_capped_frac"] < 1.0  # the -9.0 token exceeds the cap


def test_train_async_under_torchrun_with_the_local_engine_is_refused_naming_what_works(
    cli, tmp_path
):
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    done = cli("train-async", "--num-rollout", "1", "--save", tmp_path / "s", env=env)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "train-async under torchrun generates on remote engines only" in line
    assert "-m mileage train" in line


def test_keep_old_actor_recomputes_each_row_with_the_weights_that_generated_it(tiny_hf):
    import copy
    from types import SimpleNamespace

    from mileage.distributed.parallelize import full_value, swapped_weights
    from mileage.models.hf import load_causal_lm
    from mileage.rollout.buffer import Group
    from mileage.sources.ahead import correct_off_policy
    from mileage.training.algo import AlgoConfig
    from mileage.training.batch import pack_samples
    from mileage.training.mismatch import MismatchConfig
    from mileage.training.old_actor import OldActor

    model = load_causal_lm(tiny_hf)
    old_actor = OldActor(full_value, swapped_weights)
    generators = []  # independent copies of each version, for the hand computation
    torch.manual_seed(0)
    for version in range(3):  # versions 0, 1: kept; 2: the trainer's weights now
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        generators.append(copy.deepcopy(model))
        if version < 2:
            old_actor.keep(version, model)
    engine = [[-0.3, -1.2], [-2.0, -0.05], [-0.7, -0.4]]  # the engine's log-probs
    samples = [
        Sample(Prompt(i, "p", "1"), [1, 5, 6], [7, 8 + i], lp, "x", 1.0, True, i, [i, i])
        for i, lp in enumerate(engine)
    ]
    batch = pack_samples(samples, pad_id=0)
    actor = SimpleNamespace(algo=AlgoConfig(), model=model, temperature=1.0, chunk_tokens=-1)
    # by hand: row i under the weights of version i, fp32 log-softmax of the next token
    expected = torch.zeros_like(batch.old_logprobs)
    with torch.no_grad():
        for row, weights in enumerate(generators):
            logits = weights(input_ids=batch.input_ids[row : row + 1]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, batch.targets[row : row + 1, :, None])
            expected[row] = logp[0, :, 0] * batch.loss_mask[row]
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    got = old_actor.logprobs(actor, batch, [0, 1, 2], current=2)
    assert torch.allclose(got, expected, atol=1e-5)
    # the policy computed them with the kept weights swapped in, and has its own back
    assert all(torch.equal(p, own[name]) for name, p in model.named_parameters())
    # each row really needs its own version: under the trainer's weights rows 0, 1 differ
    now = old_actor.logprobs(actor, batch, [2, 2, 2], current=2)
    assert (now - expected).abs()[:2].max() > 1e-3
    # the checkpointed copy recomputes them bit for bit
    restored = OldActor(full_value, swapped_weights)
    restored.load_state_tensors({k: v.clone() for k, v in old_actor.state_tensors([0, 1]).items()})
    assert torch.equal(restored.logprobs(actor, batch, [0, 1, 2], current=2), got)
    old_actor.prune({1, 2})
    assert sorted(old_actor.versions) == [1] and old_actor.missing([0, 1]) == [0]

    # the driver: PPO's old log-probs are those; --use-tis weighs by them over the engine's
    groups = [Group(i, i, [s]) for i, s in enumerate(samples)]
    acfg = AsyncConfig(keep_old_actor=True)
    cfg = SimpleNamespace(asynchronous=acfg, mismatch=MismatchConfig(use_tis=True))
    run = SimpleNamespace(cfg=cfg, actor=actor, engine=None)
    stats = correct_off_policy(run, batch, restored, groups, trained=2)
    assert torch.equal(batch.old_logprobs, got)
    engine_lp = pack_samples(samples, 0).old_logprobs
    tis = torch.exp(got - engine_lp).clamp(0.0, 2.0) * batch.loss_mask
    assert torch.allclose(batch.tis_weights, tis, atol=1e-6)
    diff = float(((got - engine_lp).abs() * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert stats["logprob_abs_diff"] == pytest.approx(diff)


def test_a_rollout_function_s_slots_draw_one_after_another_retries_first():
    """train-async runs --rollout-function-path in the generation threads: with two of them,
    slot 1's function (fast) still draws after slot 0's (slow) has drawn all it wanted, the
    slot's retried prompts come first, unused ones go back, and the data position after the
    last slot collected is the run's."""
    import time
    from types import SimpleNamespace

    from mileage.rollout.data import PromptSource
    from mileage.sources.ahead import Producer

    prompts = [Prompt(i, f"p{i}", "1") for i in range(40)]
    drawn: list[tuple[int, list[int]]] = []
    plan = {0: (2, 2), 1: (3, 0), 2: (0, 0)}  # slot: prompts drawn before and after a pause

    def run_rollout(engine, slot, data_source, generate):
        before, after = plan[slot]
        got = data_source.next_batch(before)
        time.sleep(0.3 if slot == 0 else 0.0)  # slot 1 would draw first if not chained
        got += data_source.next_batch(after)
        drawn.append((slot, [p.index for p in got]))
        return [sample(p.index, 0) for p in (got or [prompts[39]])[:2]]

    agent = SimpleNamespace(user=SimpleNamespace(rollout=run_rollout), run_rollout=run_rollout)
    data = PromptSource(prompts, shuffle=False, seed=0)
    rollout = SimpleNamespace(rollout_batch_size=2, save_debug_rollout_data=None,
                              n_samples_per_prompt=1)  # fmt: skip
    run = SimpleNamespace(engine=object(), agent=agent, data=data,
                          cfg=SimpleNamespace(rollout=rollout,
                                              dynamic=SimpleNamespace(partial_rollout=False)),
                          group_filter=None)  # fmt: skip
    buffer = RolloutBuffer()
    buffer.retry = prompts[30:35]
    producer = Producer(run, buffer, workers=3)
    try:
        for _ in plan:  # slot 0 takes retries 30, 31; slot 1 32, 33; slot 2 34
            producer.submit(0)
        producer.drain()
    finally:
        producer.close()
    assert sorted(drawn) == [(0, [30, 31, 0, 1]), (1, [32, 33, 2]), (2, [])]
    assert buffer.retry == [prompts[34]]  # slot 2 drew nothing: its retry waits for the next
    assert data.state_dict()["offset"] == 3
    assert [g.prompt.index for g in buffer.groups] == [30, 31, 32, 33, 39]
