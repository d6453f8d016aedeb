"""--partial-rollout with the built-in tool loop, against a scripted engine that continues any
prefix of its answer: a trajectory advanced a few model tokens per round (turns cut open and
continued, tools called as their turns complete) ends exactly where one uninterrupted call ends;
rounds seed and journal by their slot; and a group is judged in the round its last trajectory
ends, with the tokens of older weights counted and masked, never the tools'."""

from __future__ import annotations

import json

import pytest
from test_multiturn import PARAMS, SCRIPT, ScriptedEngine, build_agent, make_config

from mileage.rollout.buffer import RolloutBuffer
from mileage.rollout.data import Prompt, PromptSource
from mileage.rollout.dynamic import DynamicSamplingConfig
from mileage.rollout.partial import RoundGenerator, offpolicy_tokens, sample_partial
from mileage.rollout.rollout import generate_samples
from mileage.rollout.sample import Sample
from mileage.training.batch import mask_offpolicy, pack_samples

# the hanging tool ("44+44=") is left out: its timeout is tested in test_multiturn.py
TEXTS = [t for t in SCRIPT if t != "44+44="]


class ContinuingEngine(ScriptedEngine):
    """ScriptedEngine, but an input that ends inside a turn continues that turn's answer."""

    def answer(self, text: str) -> str:
        prompt = text[: text.index("=") + 1]
        turn = text.count(">")
        done = text[text.rindex(">") + 1 :] if turn else text[len(prompt) :]
        answer = SCRIPT[prompt][turn]
        assert answer.startswith(done), "a continuation must start from its own prefix"
        return answer[len(done) :]


def trajectory(s: Sample) -> tuple:
    calls = [(c.turn, c.name, c.arguments, c.status, c.output, c.output_ids) for c in s.tool_calls]
    return s.response_ids, s.loss_mask, calls, s.stop_reason, s.turns, s.finished, s.response


def fresh(agent, prompts: list[Prompt], n: int) -> list[Sample]:
    return [
        Sample(p, agent.prompt_ids(p), [], [], "", 0.0, False, None, [], [])
        for p in prompts
        for _ in range(n)
    ]


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_trajectories_continued_round_after_round_end_where_one_call_ends(tmp_path, budget):
    prompts = [Prompt(i, t, "x") for i, t in enumerate(TEXTS)]
    agent, tok, encode = build_agent(make_config(), tmp_path / "whole")
    try:
        whole = generate_samples(
            ContinuingEngine(tok), encode, prompts, PARAMS, 2, agent.reward_fn, 7, 5, agent
        )
    finally:
        agent.close()
    agent, tok, _ = build_agent(make_config(), tmp_path / "rounds")
    engine = ContinuingEngine(tok)
    samples, opened, slot = fresh(agent, prompts, 2), 0, 0
    try:
        while any(s.stop_reason is None for s in samples):
            before = [len(s.response_ids) for s in samples]
            samples = agent.continue_tool_loop(engine, samples, PARAMS, budget, 7, slot, 2)
            for s, n in zip(samples, before, strict=True):
                s.check()
                # at most `budget` new model tokens per round (tool tokens come on top)
                assert sum(s.mask()[n:]) <= budget
            opened += sum(s.open_turn > 0 for s in samples)
            slot += 1
            assert slot < 40, "the trajectories never ended"
    finally:
        agent.close()
    assert [trajectory(s) for s in samples] == [trajectory(s) for s in whole]
    assert all(s.open_turn == 0 for s in samples)
    if budget < 3:  # "13"+EOS and "123456" take more than one round's budget: turns were cut
        assert opened > 0
    # each round's tool calls are journaled under that round's slot
    journal = sorted(p.name for p in (tmp_path / "rounds").iterdir())
    assert journal and all(name.startswith("slot_") for name in journal)


def test_rounds_judge_a_group_when_its_last_trajectory_ends(tmp_path):
    """Through RoundGenerator and sample_partial: groups finish in different rounds, the batch
    is filled, the rest stay in flight (saved as JSON with their open turns) and continue with
    newer weights; old-weight tokens are counted and masked, the tools' never."""
    config = make_config()
    config.rollout.n_samples_per_prompt = 2
    agent, tok, encode = build_agent(config, tmp_path / "journal")
    engine = ContinuingEngine(tok)
    engine.weight_version = 0
    generator = RoundGenerator(
        engine, encode, PARAMS, 2, 2, agent.reward_fn, 7, agent.journal, tool_loop=agent
    )
    prompts = [Prompt(i, t, "x") for i, t in enumerate(TEXTS)]
    source = PromptSource(prompts, shuffle=False, seed=0)
    cfg = DynamicSamplingConfig(None, over_sampling_batch_size=3, partial_rollout=True)
    buffer = RolloutBuffer()

    def rollout(rollout_id: int):
        return sample_partial(
            buffer,
            source.next_batch,
            lambda carried, new, slot: generator(carried, new, slot, rollout_id),
            None,
            None,
            None,
            cfg,
            2,
            generator.group_done,
            rollout_id,
        )

    try:
        out = rollout(0)
        # round 1 (budget 2): "22+22=" answers "4"+EOS, "33+33=" calls a tool that raises;
        # "11+11=" ("13"+EOS, a tool, then "2") is cut inside its first turn
        assert [g.prompt.text for g in out.groups] == ["22+22=", "33+33="]
        assert all(s.stop_reason is not None for g in out.groups for s in g.samples)
        in_flight = [s for g in buffer.partial for s in g.samples]
        assert [g.prompt.text for g in buffer.partial] == ["11+11="]
        assert all(s.stop_reason is None and s.open_turn == 2 for s in in_flight)
        state = json.loads(json.dumps(buffer.state_dict()))
        again = RolloutBuffer()
        again.load_state_dict(state)
        assert again.state_dict() == buffer.state_dict()  # open turns included
        engine.weight_version = 1
        out = rollout(1)
        assert "11+11=" in [g.prompt.text for g in out.groups]
        continued = [s for g in out.groups for s in g.samples if 0 in (s.weight_versions or [])]
        assert continued, "no trajectory was continued with newer weights"
        old_model_tokens = sum(
            v == 0 and m
            for s in continued
            for v, m in zip(s.weight_versions, s.mask(), strict=True)
        )
        samples = [s for g in out.groups for s in g.samples]
        assert offpolicy_tokens(samples, 1) == old_model_tokens > 0
        batch = pack_samples(samples, pad_id=0)
        assert mask_offpolicy(batch, samples, 1) == old_model_tokens
        for s in samples:  # rewards were given when the group ended
            assert s.reward == float(s.response == "x")
    finally:
        agent.close()
