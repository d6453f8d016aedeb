"""The on-policy source (`mileage train`): each rollout is generated when the loop asks, with the
trainer's current weights. Plain training draws one batch; dynamic sampling takes buffered
groups, then samples rounds until the filter has kept a batch; partial rollout continues
answers across rollouts in rounds of a token budget; a user rollout function draws and
generates itself; `--load-debug-rollout-data` replays saved samples."""

from __future__ import annotations

from mileage.checkpoint.store import CheckpointState
from mileage.components import Run
from mileage.distributed import env
from mileage.distributed.remote import where_driven
from mileage.faults import fault_point
from mileage.rollout.dynamic import sample_dynamic
from mileage.rollout.partial import RoundGenerator, offpolicy_tokens, sample_partial
from mileage.rollout.rewards.journaled import in_place
from mileage.rollout.rollout import generate_samples, load_samples, save_samples
from mileage.sources import Drawn, release_engine, sync_engine
from mileage.training.batch import TrainBatch, mask_offpolicy
from mileage.training.mismatch import apply_mismatch


class OnPolicySource:
    def __init__(self, run: Run):
        self.run = run

    def start(self) -> None:
        """Nothing of its own: dynamic sampling's buffer is a registered part of the run."""

    def draw(self, rollout_id: int) -> Drawn:
        """The rollout's prompts, their samples, and (with dynamic sampling) how they were found;
        the engine's memory then goes to training until the next update."""
        drawn = self._draw(rollout_id)
        release_engine(self.run)
        return drawn

    def _draw(self, rollout_id: int) -> Drawn:
        run = self.run
        rc = run.cfg.rollout
        if run.agent is not None and run.agent.user.rollout is not None:
            fault_point("rollout_start")
            samples = user_rollout(run, rollout_id)
            return Drawn([s.prompt for s in samples[:: rc.n_samples_per_prompt]], samples)
        if run.buffer is None:
            prompts = run.data.next_batch(rc.rollout_batch_size)
            fault_point("rollout_start")
            return Drawn(prompts, rollout_samples(run, rollout_id, prompts))
        fault_point("rollout_start")
        if run.cfg.dynamic.partial_rollout:
            sampled = partial_rollout(run, rollout_id)
        else:
            sampled = sample_dynamic(
                run.buffer,
                run.data.next_batch,
                lambda prompts, slot: rollout_samples(run, slot, prompts),  # the round's seed
                run.group_filter,
                run.cfg,
                run.buffer_filter,
                run.cfg.dynamic,
                rc.rollout_batch_size,
                rc.n_samples_per_prompt,
                rollout_id,
            )
        samples = [s for g in sampled.groups for s in g.samples]
        return Drawn([g.prompt for g in sampled.groups], samples, sampled.stats)

    def correct(self, batch: TrainBatch, drawn: Drawn, rollout_id: int) -> dict:
        """Partial rollout's tokens of older weights (counted, masked if asked), then the
        engine/trainer mismatch correction of synchronous training."""
        run, stats = self.run, {}
        if run.cfg.dynamic.partial_rollout:  # tokens of older weights: continued partial answers
            version = run.actor.step
            stats["partial_rollout/offpolicy_tokens"] = offpolicy_tokens(drawn.samples, version)
            if run.cfg.dynamic.mask_offpolicy_in_partial_rollout:
                stats["partial_rollout/offpolicy_masked"] = mask_offpolicy(
                    batch, drawn.samples, version
                )
        return {**apply_mismatch(run.cfg.mismatch, run.engine, run.actor, batch), **stats}

    def after_train(self, rollout_id: int, drawn: Drawn) -> tuple[bool, dict]:
        sync_engine(self.run)
        return True, {}

    def checkpoint(self, state: CheckpointState) -> CheckpointState:
        return state

    def close(self) -> None:
        pass


def rollout_samples(run: Run, rollout_id: int, prompts) -> list:
    rc = run.cfg.rollout
    if rc.load_debug_rollout_data:
        return load_samples(
            rc.load_debug_rollout_data, rollout_id, prompts, rc.n_samples_per_prompt
        )
    samples = generate(run, rollout_id, prompts)
    if rc.save_debug_rollout_data and env.is_main():
        save_samples(rc.save_debug_rollout_data, rollout_id, samples)
    return samples


def generate(run: Run, rollout_id: int, prompts) -> list:
    """The scored groups of `prompts`, sampled with the seed of `rollout_id` (under torchrun
    with servers: on rank 0, tools and rewards included, the samples shared with every rank)."""
    return where_driven(run.engine, lambda engine: generate_with(engine, run, rollout_id, prompts))


def generate_with(engine, run: Run, rollout_id: int, prompts) -> list:
    return generate_samples(
        engine,
        run.encode,
        prompts,
        run.sampling,
        run.cfg.rollout.n_samples_per_prompt,
        run.reward_fn,
        run.cfg.loop.seed,
        rollout_id,
        run.agent,
    )


def user_rollout(run: Run, rollout_id: int) -> list:
    """--rollout-function-path: the user's function draws from the data source and returns the
    rollout's samples (replayed from --load-debug-rollout-data like any other). Under torchrun
    with servers it runs on rank 0; the other ranks take its samples and its data position."""
    rc = run.cfg.rollout
    if rc.load_debug_rollout_data:
        return rollout_samples(run, rollout_id, run.data.next_batch(rc.rollout_batch_size))

    def job(engine) -> tuple[list, dict]:
        samples = run.agent.run_rollout(
            engine,
            rollout_id,
            run.data,
            lambda prompts: generate_with(engine, run, rollout_id, prompts),
        )
        return samples, run.data.state_dict()

    samples, position = where_driven(run.engine, job)
    run.data.load_state_dict(position)
    if rc.save_debug_rollout_data and env.is_main():
        save_samples(rc.save_debug_rollout_data, rollout_id, samples)
    return samples


def partial_rollout(run: Run, rollout_id: int):
    """One rollout of --partial-rollout: rounds of a token budget per sample, seeded by slot."""
    rc, dynamic = run.cfg.rollout, run.cfg.dynamic
    generator = round_generator(run, run.engine, lambda job: where_driven(run.engine, job))

    def advance(carried, prompts, slot):
        groups = generator(carried, prompts, slot, rollout_id)
        if rc.save_debug_rollout_data and env.is_main():  # the round's samples as they stand
            save_samples(rc.save_debug_rollout_data, slot, [s for g in groups for s in g.samples])
        return groups

    return sample_partial(
        run.buffer,
        run.data.next_batch,
        advance,
        run.group_filter,
        run.cfg,
        run.buffer_filter,
        dynamic,
        rc.rollout_batch_size,
        generator.group_done,
        rollout_id,
    )


def round_generator(run: Run, engine, drive=None) -> RoundGenerator:
    """--partial-rollout's rounds on `engine` (`drive`: where a round's job runs, its result on
    every rank; None: here, as in train-async's generation thread)."""
    rc, agent = run.cfg.rollout, run.agent
    return RoundGenerator(
        engine,
        run.encode,
        run.sampling,
        run.cfg.dynamic.round_tokens(rc.rollout_max_response_len),
        rc.n_samples_per_prompt,
        run.reward_fn,
        run.cfg.loop.seed,
        agent.journal if agent is not None else None,
        agent.score_once if agent is not None else in_place,
        # trajectories of the built-in tool loop (the only multi-turn kind a round continues)
        agent if agent is not None and agent.multi_turn else None,
        drive,
    )
