"""The ahead source (`mileage train-async`): generation runs ahead of training, exactly.

Before each rollout, the generation slots the schedule gives the engine's current weights are
submitted (a background thread generates them, overlapping the training of the rollout before:
one-step-off, slot N+1 during N); the rollout takes rollout_batch_size groups in submission
order (stale ones dropped or retried) and is corrected for the older weights that generated
them; after training, the slots in flight are waited for and the engine gets the new weights if
the interval says so. The rollout buffer (and with --keep-old-actor the weights its groups came
from) is saved with the rest, in the same commit.

Which weights generate which slot is fixed by `mileage.async_config`'s schedule, never by
timing, so a killed run rerun with the same command lands on the uninterrupted run bit for bit.
With `--fully-async --max-weight-staleness 0` it is `mileage train` exactly. How a slot is made
(plain, a user rollout function, a partial-rollout round) is `mileage.sources.producer`'s.
"""

from __future__ import annotations

from dataclasses import replace

from mileage.checkpoint.plan import RESUME
from mileage.checkpoint.registry import DATA
from mileage.checkpoint.store import CheckpointState
from mileage.checkpoint.tensors import load_old_actor_tensors
from mileage.components import Run
from mileage.distributed.parallelize import full_value, swapped_weights
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.buffer import STATE_KEY, Group, RolloutBuffer
from mileage.rollout.engine import LocalEngine
from mileage.rollout.engines.detached import DetachedLocalEngine
from mileage.sources import Drawn, sync_engine
from mileage.sources.producer import Producer
from mileage.training.batch import TrainBatch
from mileage.training.mismatch import apply_mismatch, trainer_logprobs
from mileage.training.offpolicy import decoupled_weights
from mileage.training.old_actor import OldActor


class AheadSource:
    def __init__(self, run: Run):
        self.run = run
        own_engine(run)  # before the loop's start hands the engine its weights
        if run.buffer is None:  # with a dynamic-sampling filter, build_run made and registered it
            # a fresh start's (or a `mileage train` checkpoint's) first slot is the first
            # rollout, seeded as `mileage train` seeds it; a checkpoint's buffer says otherwise
            run.buffer = RolloutBuffer()
            run.buffer.next_slot = run.plan.start_rollout_id
            run.parts.register(STATE_KEY, run.buffer, DATA)
        self.producer: Producer | None = None
        self.old_actor: OldActor | None = None
        self.engine_policy = 0
        self.stale = 0  # groups the last draw passed over as too stale

    def start(self) -> None:
        run, acfg = self.run, self.run.cfg.asynchronous
        buffer = run.buffer  # restored with the data position, by the run's registry
        self.producer = Producer(run, buffer, acfg.workers(run.cfg.rollout.samples_per_rollout))
        # the weights the engine holds, in trained rollouts, as the uninterrupted run has them
        self.engine_policy = acfg.engine_rollouts(run.plan.start_rollout_id)
        self.old_actor = restored_old_actor(run, buffer, self.engine_policy)

    def draw(self, rollout_id: int) -> Drawn:
        submit_due(self.producer, self.engine_policy, rollout_id)
        fault_point("rollout_start")
        groups, self.stale, self.engine_policy = take_groups(
            self.run, self.producer, self.engine_policy, rollout_id, self.old_actor
        )
        samples = [s for g in groups for s in g.samples]
        return Drawn([g.prompt for g in groups], samples, {}, groups)

    def correct(self, batch: TrainBatch, drawn: Drawn, rollout_id: int) -> dict:
        run, acfg = self.run, self.run.cfg.asynchronous
        if acfg.corrects(run.cfg.rollout.rollout_batch_size) or acfg.keep_old_actor:
            return correct_off_policy(run, batch, self.old_actor, drawn.groups, rollout_id)
        return apply_mismatch(run.cfg.mismatch, run.engine, run.actor, batch)

    def after_train(self, rollout_id: int, drawn: Drawn) -> tuple[bool, dict]:
        """Wait for the slots in flight, then hand the weights over if the interval says so."""
        run, producer = self.run, self.producer
        producer.drain()
        last_rollout = rollout_id == run.plan.num_rollout - 1
        if (rollout_id + 1) % run.cfg.asynchronous.update_weights_interval == 0 or last_rollout:
            fault_point("before_weight_sync")
            hand_weights(run, self.old_actor, rollout_id + 1)
            self.engine_policy = rollout_id + 1
        if self.old_actor is not None:
            self.old_actor.prune(versions_needed(producer, self.engine_policy))
        extra = staleness_stats(drawn.groups, rollout_id, self.stale)
        if run.group_filter is not None:
            extra |= filter_stats(producer.buffer)
        if run.cfg.dynamic.partial_rollout:  # counted with nothing in flight: as on a resume
            extra |= partial_stats(drawn.samples, producer.buffer)
        # the loop's rate divides by the wait for groups generated ahead
        extra["tokens_per_s"] = generation_rate(drawn.groups, producer.slot_time)
        producer.forget_times(g.slot for g in producer.buffer.groups)
        return self.engine_policy == rollout_id + 1, extra

    def checkpoint(self, state: CheckpointState) -> CheckpointState:
        """The weights the buffered groups came from (the buffer is a registered part)."""
        buffer = self.producer.buffer
        if self.old_actor is not None:  # the weights the buffered groups came from
            state.old_actor = self.old_actor.state_tensors(g.policy_rollouts for g in buffer.groups)
        return state

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()


def restored_old_actor(run: Run, buffer: RolloutBuffer, engine_policy: int) -> OldActor | None:
    """--keep-old-actor: the weights of every buffered group's version, from the checkpoint,
    and the engine's current ones when they are the trainer's (just restored)."""
    if not run.cfg.asynchronous.keep_old_actor:
        return None
    old_actor = OldActor(full_value, swapped_weights)
    plan = run.plan
    if plan.action == RESUME and plan.load_data_state:
        old_actor.load_state_tensors(load_old_actor_tensors(plan.weights_from))
    if engine_policy == plan.start_rollout_id:
        old_actor.keep(engine_policy, run.model)
    missing = old_actor.missing(g.policy_rollouts for g in buffer.groups)
    if missing:
        raise UserError(
            f"--keep-old-actor: the checkpoint {plan.weights_from} holds groups generated with "
            f"weight version(s) {', '.join(map(str, missing))} but not those weights (it was "
            "written without --keep-old-actor); resume with the flags that wrote it"
        )
    return old_actor


def hand_weights(run: Run, old_actor: OldActor | None, version: int) -> None:
    """Sync the engine to the trainer's weights (`version` trained rollouts), keeping a copy
    of them on the trainer with --keep-old-actor."""
    sync_engine(run)
    if old_actor is not None:
        old_actor.keep(version, run.model)


def versions_needed(producer: Producer, engine_policy: int) -> set[int]:
    """Weight versions that untrained groups, slots in flight or future slots come from."""
    buffered = {g.policy_rollouts for g in producer.buffer.groups}
    return buffered | {policy for _, policy, _ in producer.pending} | {engine_policy}


def own_engine(run: Run) -> None:
    """The in-process engine generates in a thread, so it gets a copy of the weights."""
    engine = run.engine
    if isinstance(engine, LocalEngine) and not isinstance(engine, DetachedLocalEngine):
        run.engine = DetachedLocalEngine(engine.model, engine.pad_id, engine.eos_id)


def correct_off_policy(
    run: Run,
    batch: TrainBatch,
    old_actor: OldActor | None = None,
    groups: list[Group] | None = None,
    trained: int = 0,
) -> dict:
    """The proximal log-probs (the trainer's weights now) and the behaviour correction; with
    --keep-old-actor, the old log-probs recomputed with the weights that generated each row
    (`groups`' versions; `trained`: the trainer's own version), the mismatch flags as in train."""
    acfg, mismatch = run.cfg.asynchronous, run.cfg.mismatch
    if acfg.keep_old_actor:
        versions = [g.policy_rollouts for g in groups for _ in g.samples]
        recomputed = old_actor.logprobs(run.actor, batch, versions, trained)
        return apply_mismatch(mismatch, run.engine, run.actor, batch, recomputed=recomputed)
    if acfg.correction == "tis":
        return apply_mismatch(replace(mismatch, use_tis=True), run.engine, run.actor, batch)
    behaviour = batch.old_logprobs
    proximal = trainer_logprobs(run.actor, batch)
    mask = batch.loss_mask
    weights, stats = decoupled_weights(proximal, behaviour, mask, acfg.behav_imp_weight_cap)
    diff = ((proximal - behaviour).abs() * mask).sum() / mask.sum().clamp(min=1.0)
    batch.old_logprobs, batch.tis_weights = proximal, weights
    return {**stats, "logprob_abs_diff": float(diff)}


def submit_due(producer: Producer, engine_policy: int, rollout_id: int) -> None:
    """Every slot the schedule gives the engine's current weights, while the run still needs
    groups (counted against what is generated or generating, so nothing is made twice)."""
    run, buffer = producer.run, producer.buffer
    size = run.cfg.rollout.rollout_batch_size
    last = run.cfg.asynchronous.last_slot_of_version(engine_policy, size)
    needed = (run.plan.num_rollout - rollout_id) * size
    while buffer.next_slot <= last and producer.groups_ahead() < needed:
        producer.submit(engine_policy)


def take_groups(
    run: Run,
    producer: Producer,
    engine_policy: int,
    rollout_id: int,
    old_actor: OldActor | None = None,
) -> tuple[list[Group], int, int]:
    """Rollout `rollout_id`'s groups in submission order, the stale ones passed over, and the
    engine's weights after (stale groups that leave the run short are made up for with the
    trainer's current weights, synced first)."""
    acfg, buffer = run.cfg.asynchronous, producer.buffer
    size = run.cfg.rollout.rollout_batch_size
    groups: list[Group] = []
    stale = 0
    made_up = 0  # slots submitted beyond the schedule's to fill this rollout
    while True:
        more, passed = buffer.take(
            size - len(groups),
            rollout_id,
            acfg.max_weight_staleness,
            acfg.async_unused_samples_handler,
        )
        groups, stale = groups + more, stale + len(passed)
        if len(groups) == size:
            return groups, stale, engine_policy
        if producer.pending:
            producer.collect_oldest()
            continue
        if made_up == run.cfg.dynamic.dynamic_sampling_max_rounds:
            reasons = ", ".join(f"{r} {c}" for r, c in sorted(buffer.filtered.items()))
            raise UserError(
                f"rollout {rollout_id}: {len(groups)} of {size} groups after {made_up} extra "
                f"slots (dropped by the filter so far: {reasons or 'none'}); raise "
                "--dynamic-sampling-max-rounds or filter less"
            )
        if engine_policy != rollout_id:
            hand_weights(run, old_actor, rollout_id)
            engine_policy = rollout_id
        producer.submit(engine_policy)
        made_up += 1


def generation_rate(groups: list[Group], slot_time: dict[int, tuple[float, int]]) -> float | None:
    """Response tokens per second of generation for `groups`: each is charged its slot's busy
    seconds in proportion to its tokens, so a rollout of whole slots gets their own rate. None
    when no group's slot was timed here (all restored from a checkpoint)."""
    tokens = seconds = 0.0
    for group in groups:
        if group.slot not in slot_time:
            continue
        busy, slot_tokens = slot_time[group.slot]
        count = sum(len(s.response_ids) for s in group.samples)
        tokens += count
        seconds += busy * count / slot_tokens if slot_tokens else 0.0
    return tokens / seconds if seconds > 0 else None


def staleness_stats(groups: list[Group], trained: int, stale: int) -> dict:
    ages = [trained - g.policy_rollouts for g in groups]
    return {
        "staleness_mean": sum(ages) / len(ages),
        "staleness_max": max(ages),
        "stale_groups": stale,
    }


def filter_stats(buffer: RolloutBuffer) -> dict:
    """With --dynamic-sampling-filter-path: the groups dropped so far, in all and by reason
    (counted over the run, so a resumed run logs what the uninterrupted one does)."""
    return {
        "dynamic_filter/groups_dropped": sum(buffer.filtered.values()),
        **{f"dynamic_filter/drop_{r}": c for r, c in sorted(buffer.filtered.items())},
    }


def partial_stats(samples: list, buffer: RolloutBuffer) -> dict:
    """--partial-rollout: the rollout's samples whose tokens came from more than one weight
    version (continued across slots), and the groups still in flight after it."""
    return {
        "partial_rollout/continued_samples": sum(
            len(set(s.weight_versions or [])) > 1 for s in samples
        ),
        "partial_rollout/groups_in_flight": len(buffer.partial),
    }
