"""The driver: the algorithm of a run, top to bottom, for `mileage train` and `train-async`.

for each rollout_id in [start_rollout_id, num_rollout):
    draw the rollout's scored samples from the source (on-policy: sampled now with the
    current policy; ahead: generated earlier, in a background thread, by scheduled weights),
    shape the rewards, pack the batch, let the source correct it for the weights that made it,
    turn rewards into advantages and train the policy on them,
    hand the new weights to the generator as the source schedules it,
    evaluate on schedule, log, save on schedule (the source's own state in the same commit).
A SIGTERM/SIGINT or the sentinel file makes the current rollout the last one saved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from mileage.checkpoint.plan import RESUME
from mileage.checkpoint.store import CheckpointState
from mileage.components import Run, checkpoint_state, restore
from mileage.distributed.coordination import on_rank0, preemption_guard
from mileage.distributed.remote import where_driven
from mileage.errors import UserError
from mileage.faults import fault_point, poison_point
from mileage.metrics import EVAL_BEFORE_TRAINING
from mileage.progress import RunProgress
from mileage.rollout.evaluation import evaluate, rollout_passrate, summary
from mileage.rollout.sample import tool_metrics
from mileage.rollout.shaping import shape_rewards
from mileage.sources import Drawn, RolloutSource, sync_engine
from mileage.training.batch import TrainBatch, mask_truncated, pack_samples, response_values
from mileage.training.finite import NonFiniteError, check_checkpoint
from mileage.training.memory_use import peak_record, reset_peak


def can_eval(run: Run) -> bool:
    """Evaluation needs held-out prompts and a generator; without them there is nothing to say."""
    return bool(run.cfg.loop.eval_interval) and bool(run.eval_sets) and run.engine is not None


def run_eval(run: Run, rollout_id: int) -> dict[str, float]:
    """The eval/NAME/... metrics (and eval_accuracy) of the weights after `rollout_id`."""
    cfg = run.cfg
    # under torchrun with servers: on rank 0 (tools and rewards once), the metrics shared
    return where_driven(
        run.engine,
        lambda engine: evaluate(
            engine,
            run.encode,
            run.eval_sets,
            cfg.eval,
            cfg.rollout,
            run.reward_fn,
            cfg.loop.seed,
            rollout_id,
            run.agent.score if run.agent is not None else None,
            run.agent,
        ),
    )


def eval_due(run: Run, rollout_id: int) -> bool:
    interval = run.cfg.loop.eval_interval
    last = rollout_id == run.plan.num_rollout - 1
    return can_eval(run) and ((rollout_id + 1) % interval == 0 or last)


def evaluate_if_due(run: Run, progress: RunProgress, record: dict) -> None:
    """Add the held-out metrics to the rollout's record when the eval interval says so."""
    if eval_due(run, record["rollout_id"]):
        progress.phase(record["rollout_id"], "eval")
        record |= run_eval(run, record["rollout_id"])


def prune_tool_journal(run: Run) -> None:
    """Drop the tool journal's entries that no rollout of this run can generate again: those of
    slots before the checkpoint it starts from (all of them on a fresh start); what is left is
    read now, so a damaged journal stops the run before it trains (rank 0 owns the journal)."""
    if run.agent is not None:
        journal, resumed = run.agent.journal, run.plan.action == RESUME
        keep_from = run.plan.start_rollout_id if resumed else 1 << 62

        def prune_and_check() -> None:
            journal.prune(keep_from)
            journal.check()

        on_rank0(prune_and_check)


def start(run: Run, progress: RunProgress) -> None:
    """Restore the run, hand the engine its weights, evaluate before training if asked."""
    restore(run, progress.print)
    prune_tool_journal(run)
    sync_engine(run)  # a server may hold other weights than the ones just restored
    cfg = run.cfg
    if can_eval(run) and run.plan.start_rollout_id == 0 and not cfg.loop.skip_eval_before_train:
        # recorded as the point the held-out curve starts from (miles logs it at step 0)
        metrics = run_eval(run, EVAL_BEFORE_TRAINING)
        run.metrics.log({"rollout_id": EVAL_BEFORE_TRAINING, **metrics})
        progress.print(f"eval before training: {summary(metrics)}")


def train(run: Run, progress: RunProgress, source: RolloutSource) -> tuple[list[dict], str | None]:
    cfg, plan = run.cfg, run.plan
    start(run, progress)
    source.start()
    records = []

    def state(run: Run, rollout_id: int) -> CheckpointState:
        """What a save commits: the run's parts, and the source's own state with them."""
        return source.checkpoint(checkpoint_state(run, rollout_id))

    stop_reason = None
    try:
        # under torchrun, the stop and sentinel answers below are agreed by all ranks
        with preemption_guard(
            cfg.loop.save_trigger_sentinel, cfg.loop.stop_grace_seconds
        ) as preempt:
            for rollout_id in range(plan.start_rollout_id, plan.num_rollout):
                started = time.perf_counter()
                reset_peak(run.device)
                progress.phase(rollout_id, "generate")
                drawn = source.draw(rollout_id)
                generated = time.perf_counter()
                fault_point("after_generate")

                progress.phase(rollout_id, "train")
                batch, sampling = prepare_batch(run, drawn, rollout_id)
                correction = source.correct(batch, drawn, rollout_id)
                stats = {**train_rollout(run, rollout_id, batch), **correction, **sampling}
                run.actor.release_gradients()
                trained = time.perf_counter()
                engine_current, extra = source.after_train(rollout_id, drawn)
                synced = time.perf_counter()
                fault_point("after_train")

                times = (started, generated, trained, synced)
                record = rollout_record(rollout_id, drawn.prompts, drawn.samples, stats, times)
                record.update(extra)
                record |= peak_record(run.device, rollout_estimate(run))
                if cfg.eval.log_passrate:
                    record |= rollout_passrate(drawn.samples, cfg.rollout.n_samples_per_prompt)
                if engine_current:  # evaluation generates with the engine
                    evaluate_if_due(run, progress, record)
                stop_reason = log_and_save(run, progress, preempt, record, records, state)
                if stop_reason:
                    break
            if run.writer is not None:
                run.writer.wait()
    finally:
        source.close()
    finish(run, progress, records, stop_reason)
    return records, stop_reason


def rollout_estimate(run: Run) -> int | None:
    """The peak the memory estimate expects of the rollout just trained (its largest forward)."""
    if run.memory is None:
        return None
    return run.memory.rollout_estimate(run.actor.largest_pass_tokens, run.actor.largest_pass_logits)


def prepare_batch(run: Run, drawn: Drawn, rollout_id: int) -> tuple[TrainBatch, dict]:
    """The trained batch of the drawn samples, what shaping did to it, and a served OPD
    teacher's scores of it. The overlong penalty shapes the trained reward only: the filter,
    accuracy and reward_mean see the task's own reward."""
    cfg = run.cfg
    sampling = dict(drawn.stats)
    shaped = shape_rewards(drawn.samples, cfg.shaping, cfg.rollout.rollout_max_response_len)
    batch = pack_samples(shaped, run.tokenizer.pad_token_id).to(run.device)
    if cfg.shaping.overlong_buffer_len:
        sampling["overlong_reward_mean"] = float(batch.rewards.mean())
    if cfg.shaping.mask_truncated_completions:
        sampling["truncated_masked"] = mask_truncated(batch, drawn.samples)
    if run.teacher is not None:  # rank 0 asks the server (journaled); every rank gets them
        scores = on_rank0(lambda: run.teacher.score(drawn.samples, rollout_id))
        batch.teacher_logprobs = response_values(batch, drawn.samples, scores).to(run.device)
    return batch, sampling


def train_rollout(run: Run, rollout_id: int, batch) -> dict:
    """The actor's optimizer steps on the rollout's batch. A NaN or inf in a reward, loss,
    gradient or weight stops the run here, before anything of the rollout is saved (an
    in-flight save of an earlier rollout is finished first)."""
    with nonfinite_stop(run, rollout_id):
        return run.actor.train_rollout(batch)


@contextmanager
def nonfinite_stop(run: Run, rollout_id: int) -> Iterator[None]:
    """Turn a `NonFiniteError` into the run's last line: the rollout, the quantity, and where a
    rerun continues (the last committed checkpoint is left as it was)."""
    try:
        yield
    except NonFiniteError as exc:
        if run.writer is not None:
            run.writer.wait()
        where = (
            "nothing of it was saved; the last committed checkpoint stays the latest"
            if run.writer is not None
            else "nothing was saved (no --save)"
        )
        raise UserError(f"rollout {rollout_id}: {exc}; {where}") from None


def log_and_save(run: Run, progress: RunProgress, preempt, record: dict, records: list, state):
    """Log the rollout's record, save it if due (`state(run, rollout_id)` gives what to save),
    append it to `records`; returns why the run stops after it (None: it goes on)."""
    cfg, rollout_id = run.cfg, record["rollout_id"]
    run.metrics.log(record)  # before the save: a resume cuts the log back to the checkpoint
    fault_point("after_metrics")

    # decided once: a signal arriving after this line stops (and saves) the next rollout
    stop_reason = None
    if preempt.stop_requested:
        stop_reason = preempt.signal_name
    elif len(records) + 1 == cfg.loop.debug_exit_after_rollout:
        stop_reason = "--debug-exit-after-rollout"
    sentinel = preempt.sentinel_present()
    scheduled = run.writer is not None and run.writer.due(rollout_id, run.plan.num_rollout)
    if run.writer is not None and (scheduled or sentinel or stop_reason):
        progress.phase(rollout_id, "save")
        snapshot = state(run, rollout_id)
        poison_point("nan_before_commit", list(snapshot.model.values()))
        with nonfinite_stop(run, rollout_id):
            check_checkpoint(snapshot)  # a NaN checkpoint never becomes the tracked one
        run.writer.save(rollout_id, snapshot)
        record["saved"] = True
    if sentinel:
        preempt.clear_sentinel()
    progress.done(record)
    records.append(record)
    return stop_reason


def finish(run: Run, progress: RunProgress, records: list[dict], stop_reason: str | None) -> None:
    """Close the metrics log and say where a stopped run resumes."""
    run.metrics.close()
    if stop_reason:
        where = (
            f"rerun the same command to resume at rollout {records[-1]['rollout_id'] + 1}"
            if run.writer is not None
            else "nothing was saved (no --save)"
        )
        progress.print(
            f"stopped after rollout {records[-1]['rollout_id']} ({stop_reason}); {where}"
        )


def rollout_record(
    rollout_id: int, prompts, samples, stats: dict, times: tuple[float, float, float, float]
) -> dict:
    """One metrics.jsonl line; `times` are when the rollout started, generation and training
    ended, and the engine had the new weights."""
    started, generated, trained, synced = times
    rewards = [s.reward for s in samples]
    response_tokens = sum(len(s.response_ids) for s in samples)
    return {
        **tool_metrics(samples),
        "rollout_id": rollout_id,
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "response_len": response_tokens / len(samples),
        "prompt_indices": [p.index for p in prompts],
        **stats,
        "tokens_per_s": response_tokens / max(generated - started, 1e-9),
        "gen_time": generated - started,
        "train_time": trained - generated,
        "sync_time": synced - trained,
        "step_time": synced - started,
    }
