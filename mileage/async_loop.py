"""The async driver (`mileage train-async`): generation runs ahead of training, exactly.

for each rollout_id in [start_rollout_id, num_rollout):
    submit the generation slots the schedule gives the engine's current weights (a background
    thread generates them, overlapping the training below: one-step-off, slot N+1 during N),
    take rollout_batch_size groups in submission order (stale ones dropped or retried),
    correct for the older weights that generated them and train on them,
    wait for the slots in flight, hand the new weights to the engine if the interval says so,
    evaluate, log, save (the rollout buffer with the rest, in the same commit).

Which weights generate which slot is fixed by `mileage.async_config`'s schedule, never by
timing, so a killed run rerun with the same command lands on the uninterrupted run bit for bit.
With `--fully-async --max-weight-staleness 0` it is `mileage train` exactly.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import replace

from mileage.checkpoint.plan import RESUME
from mileage.checkpoint.store import TRAINER_STATE, CheckpointState, read_json
from mileage.checkpoint.tensors import load_old_actor_tensors
from mileage.components import Run, checkpoint_state
from mileage.distributed.background import BackgroundGeneration
from mileage.distributed.coordination import preemption_guard
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.loop import (
    evaluate_if_due,
    finish,
    log_and_save,
    rollout_record,
    start,
    sync_engine,
    train_rollout,
)
from mileage.progress import RunProgress
from mileage.rollout.buffer import STATE_KEY, Group, RolloutBuffer
from mileage.rollout.engine import LocalEngine
from mileage.rollout.engines.detached import DetachedLocalEngine
from mileage.rollout.rollout import generate_samples, save_samples
from mileage.training.batch import TrainBatch, pack_samples
from mileage.training.mismatch import apply_mismatch, trainer_logprobs
from mileage.training.offpolicy import decoupled_weights
from mileage.training.old_actor import OldActor


class Producer:
    """Generates slots in a background thread; results are collected in submission order."""

    def __init__(self, run: Run, buffer: RolloutBuffer, workers: int):
        self.run = run
        self.buffer = buffer
        # threads where the engine is driven (under torchrun: rank 0, results broadcast)
        self.background = BackgroundGeneration(run.engine, workers)
        self.pending: deque[tuple[int, int, Future | None]] = deque()  # (slot, policy, result)
        # slot -> (seconds the generation thread spent on it, its response tokens): the
        # throughput of a rollout is the generator's, not tokens over the trainer's wait
        self.slot_time: dict[int, tuple[float, int]] = {}

    def submit(self, policy_rollouts: int) -> None:
        """The next slot, generated with the engine's current weights (`policy_rollouts`)."""
        run, size = self.run, self.run.cfg.rollout.rollout_batch_size
        prompts = self.buffer.draw_retries(size)
        prompts += run.data.next_batch(size - len(prompts))  # drawn here, in order
        slot = self.buffer.next_slot
        self.buffer.next_slot += 1
        self.pending.append(
            (slot, policy_rollouts, self.background.submit(self._generate, slot, prompts))
        )

    def _generate(self, engine, slot: int, prompts) -> tuple[list, float]:
        """The slot's samples and the seconds this thread spent generating them."""
        fault_point("async_generating")  # in the thread, while the trainer trains
        began = time.perf_counter()
        rc = self.run.cfg.rollout
        samples = generate_samples(
            engine,
            self.run.encode,
            prompts,
            self.run.sampling,
            rc.n_samples_per_prompt,
            self.run.reward_fn,
            self.run.cfg.loop.seed,
            slot,
            self.run.agent,
        )
        return samples, time.perf_counter() - began

    def groups_ahead(self) -> int:
        """Groups generated or generating that no rollout has taken yet."""
        size = self.run.cfg.rollout.rollout_batch_size
        return len(self.buffer.groups) + len(self.pending) * size

    def collect_oldest(self) -> None:
        slot, policy, future = self.pending.popleft()
        samples, seconds = self.background.result(future)
        self.slot_time[slot] = (seconds, sum(len(s.response_ids) for s in samples))
        rc = self.run.cfg.rollout
        if rc.save_debug_rollout_data:
            save_samples(rc.save_debug_rollout_data, slot, samples)
        self.buffer.put(slot, policy, samples, rc.n_samples_per_prompt)

    def forget_times(self, untrained_slots) -> None:
        """Drop the times of slots no untrained group or slot in flight comes from."""
        keep = {*untrained_slots, *(slot for slot, _, _ in self.pending)}
        self.slot_time = {s: t for s, t in self.slot_time.items() if s in keep}

    def drain(self) -> None:
        """Wait for every slot in flight (before the engine's weights change, and before a save)."""
        while self.pending:
            self.collect_oldest()

    def close(self) -> None:
        self.background.close()


def restored_buffer(run: Run) -> RolloutBuffer:
    buffer = RolloutBuffer()
    plan = run.plan
    # without a saved buffer (a fresh start, or a checkpoint of `mileage train`) the first slot
    # is the first rollout, seeded as `mileage train` would seed it
    buffer.next_slot = plan.start_rollout_id
    if plan.action == RESUME and plan.load_data_state:  # the buffer belongs to the data position
        state = read_json(plan.weights_from, TRAINER_STATE).get(STATE_KEY)
        if state:
            buffer.load_state_dict(state)
    return buffer


def restored_old_actor(run: Run, buffer: RolloutBuffer, engine_policy: int) -> OldActor | None:
    """--keep-old-actor: the weights of every buffered group's version, from the checkpoint,
    and the engine's current ones when they are the trainer's (just restored)."""
    if not run.cfg.asynchronous.keep_old_actor:
        return None
    old_actor = OldActor()
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
        if engine_policy != rollout_id:
            hand_weights(run, old_actor, rollout_id)
            engine_policy = rollout_id
        producer.submit(engine_policy)


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


def train_async(run: Run, progress: RunProgress) -> tuple[list[dict], str | None]:
    cfg, plan, acfg = run.cfg, run.plan, run.cfg.asynchronous
    size = cfg.rollout.rollout_batch_size
    if run.agent is not None and run.agent.user.rollout is not None:
        raise UserError(
            "--rollout-function-path is not supported by train-async (its producer draws the "
            "prompts); use --custom-generate-function-path, which is"
        )
    own_engine(run)
    start(run, progress)
    buffer = restored_buffer(run)
    producer = Producer(run, buffer, acfg.workers(cfg.rollout.samples_per_rollout))
    # the weights the engine holds, in trained rollouts, as the uninterrupted run has them
    engine_policy = acfg.engine_rollouts(plan.start_rollout_id)
    old_actor = restored_old_actor(run, buffer, engine_policy)
    records: list[dict] = []
    stop_reason = None

    def state(run: Run, rollout_id: int) -> CheckpointState:
        """The checkpoint, with the rollout buffer in its trainer state (one atomic commit)."""
        saved = checkpoint_state(run, rollout_id)
        saved.trainer[STATE_KEY] = buffer.state_dict()
        if old_actor is not None:  # the weights the buffered groups came from
            saved.old_actor = old_actor.state_tensors(g.policy_rollouts for g in buffer.groups)
        return saved

    try:
        with preemption_guard(
            cfg.loop.save_trigger_sentinel, cfg.loop.stop_grace_seconds
        ) as preempt:
            for rollout_id in range(plan.start_rollout_id, plan.num_rollout):
                started = time.perf_counter()
                progress.phase(rollout_id, "generate")

                submit_due(producer, engine_policy, rollout_id)
                fault_point("rollout_start")
                groups, stale, engine_policy = take_groups(
                    run, producer, engine_policy, rollout_id, old_actor
                )
                samples = [s for g in groups for s in g.samples]
                generated = time.perf_counter()
                fault_point("after_generate")

                progress.phase(rollout_id, "train")
                batch = pack_samples(samples, run.tokenizer.pad_token_id).to(run.device)
                if acfg.corrects(size) or acfg.keep_old_actor:
                    correction = correct_off_policy(run, batch, old_actor, groups, rollout_id)
                else:
                    correction = apply_mismatch(cfg.mismatch, run.engine, run.actor, batch)
                stats = {**train_rollout(run, rollout_id, batch), **correction}
                trained = time.perf_counter()
                producer.drain()
                last_rollout = rollout_id == plan.num_rollout - 1
                if (rollout_id + 1) % acfg.update_weights_interval == 0 or last_rollout:
                    fault_point("before_weight_sync")
                    hand_weights(run, old_actor, rollout_id + 1)
                    engine_policy = rollout_id + 1
                if old_actor is not None:
                    old_actor.prune(versions_needed(producer, engine_policy))
                synced = time.perf_counter()
                fault_point("after_train")

                prompts = [g.prompt for g in groups]
                record = rollout_record(
                    rollout_id, prompts, samples, stats, (started, generated, trained, synced)
                )
                record.update(staleness_stats(groups, rollout_id, stale))
                # rollout_record's rate divides by the wait for groups generated ahead
                record["tokens_per_s"] = generation_rate(groups, producer.slot_time)
                producer.forget_times(g.slot for g in producer.buffer.groups)
                if engine_policy == rollout_id + 1:  # evaluation generates with the engine
                    evaluate_if_due(run, progress, record)
                stop_reason = log_and_save(run, progress, preempt, record, records, state)
                if stop_reason:
                    break
            if run.writer is not None:
                run.writer.wait()
    finally:
        producer.close()
    finish(run, progress, records, stop_reason)
    return records, stop_reason


def check_async_run(run_cfg, world_size: int) -> None:
    """What train-async refuses before anything is built (one line each, exit 2)."""
    rc = run_cfg.rollout
    if world_size > 1 and not run_cfg.engine.remote:
        raise UserError(
            "train-async under torchrun generates on remote engines only (--rollout-engine "
            "sglang with --rollout-url, e.g. `mileage serve`); run it as one process for the "
            "in-process engine, or train synchronously under torchrun with "
            "`torchrun ... -m mileage train ...`"
        )
    if world_size > 1 and run_cfg.asynchronous.keep_old_actor:
        raise UserError(
            "--keep-old-actor keeps whole weight copies and is not available under torchrun "
            "yet; use the default decoupled correction there"
        )
    if rc.load_debug_rollout_data:
        raise UserError(
            "--load-debug-rollout-data replays saved rollouts and has no engine to generate "
            "ahead with; replay with `mileage train`"
        )
    acfg = run_cfg.asynchronous
    acfg.validate(rc.rollout_batch_size, rc.samples_per_rollout)
    mc = run_cfg.mismatch
    if acfg.keep_old_actor and mc.use_rollout_logprobs:
        raise UserError(
            "--use-rollout-logprobs takes the engine's log-probs as the PPO ratio's denominator, "
            "which --keep-old-actor recomputes with the weights that generated them; choose one"
        )
    corrects = acfg.corrects(rc.rollout_batch_size) and not acfg.keep_old_actor
    if corrects and (mc.use_tis or mc.use_rollout_logprobs):
        raise UserError(
            "--use-tis / --use-rollout-logprobs choose the old policy of synchronous "
            "training; with samples from older weights, --off-policy-correction does "
            "(decoupled or tis), or --keep-old-actor with them"
        )
