"""The driver loop: the algorithm of a run, top to bottom.

for each rollout_id in [start_rollout_id, num_rollout):
    take the next prompts, sample n answers each with the current policy, score them,
    turn rewards into advantages and train the policy on them,
    log, save on schedule, hand the new weights to the generator, evaluate on schedule.
A SIGTERM/SIGINT or the sentinel file makes the current rollout the last one saved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from mileage.checkpoint.plan import RESUME
from mileage.components import Run, checkpoint_state, restore
from mileage.distributed import env
from mileage.distributed.coordination import preemption_guard
from mileage.errors import UserError
from mileage.faults import fault_point, poison_point
from mileage.metrics import EVAL_BEFORE_TRAINING
from mileage.progress import RunProgress
from mileage.rollout.agent import tool_metrics
from mileage.rollout.dynamic import sample_dynamic
from mileage.rollout.evaluation import evaluate, rollout_passrate, summary
from mileage.rollout.partial import RoundGenerator, offpolicy_tokens, sample_partial
from mileage.rollout.rollout import generate_samples, load_samples, save_samples
from mileage.rollout.shaping import shape_rewards
from mileage.training.batch import mask_offpolicy, mask_truncated, pack_samples
from mileage.training.finite import NonFiniteError, check_checkpoint
from mileage.training.mismatch import apply_mismatch


def can_eval(run: Run) -> bool:
    """Evaluation needs held-out prompts and a generator; without them there is nothing to say."""
    return bool(run.cfg.loop.eval_interval) and bool(run.eval_sets) and run.engine is not None


def run_eval(run: Run, rollout_id: int) -> dict[str, float]:
    """The eval/NAME/... metrics (and eval_accuracy) of the weights after `rollout_id`."""
    cfg = run.cfg
    return evaluate(
        run.engine,
        run.encode,
        run.eval_sets,
        cfg.eval,
        cfg.rollout,
        run.reward_fn,
        cfg.loop.seed,
        rollout_id,
        run.agent.score if run.agent is not None else None,
        run.agent,
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
    """The scored groups of `prompts`, sampled with the seed of `rollout_id`."""
    return generate_samples(
        run.engine,
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
    rollout's samples (replayed from --load-debug-rollout-data like any other)."""
    rc = run.cfg.rollout
    if rc.load_debug_rollout_data:
        return rollout_samples(run, rollout_id, run.data.next_batch(rc.rollout_batch_size))
    samples = run.agent.run_rollout(
        run.engine,
        rollout_id,
        run.data,
        lambda prompts: generate(run, rollout_id, prompts),
    )
    if rc.save_debug_rollout_data and env.is_main():
        save_samples(rc.save_debug_rollout_data, rollout_id, samples)
    return samples


def draw_rollout(run: Run, rollout_id: int) -> tuple[list, list, dict]:
    """The rollout's prompts, their samples, and (with dynamic sampling) how they were found:
    plain training draws one batch; dynamic sampling takes buffered groups, then samples rounds
    until the filter has kept a batch (`mileage.rollout.dynamic`)."""
    rc = run.cfg.rollout
    if run.agent is not None and run.agent.user.rollout is not None:
        fault_point("rollout_start")
        samples = user_rollout(run, rollout_id)
        return [s.prompt for s in samples[:: rc.n_samples_per_prompt]], samples, {}
    if run.buffer is None:
        prompts = run.data.next_batch(rc.rollout_batch_size)
        fault_point("rollout_start")
        return prompts, rollout_samples(run, rollout_id, prompts), {}
    fault_point("rollout_start")
    if run.cfg.dynamic.partial_rollout:
        sampled = partial_rollout(run, rollout_id)
    else:
        sampled = sample_dynamic(
            run.buffer,
            run.data.next_batch,
            lambda prompts, slot: rollout_samples(run, slot, prompts),  # seeded by the round's slot
            run.group_filter,
            run.cfg,
            run.buffer_filter,
            run.cfg.dynamic,
            rc.rollout_batch_size,
            rc.n_samples_per_prompt,
            rollout_id,
        )
    samples = [s for g in sampled.groups for s in g.samples]
    return [g.prompt for g in sampled.groups], samples, sampled.stats


def partial_rollout(run: Run, rollout_id: int):
    """One rollout of --partial-rollout: rounds of a token budget per sample, seeded by slot."""
    rc, dynamic = run.cfg.rollout, run.cfg.dynamic
    generator = RoundGenerator(
        run.engine,
        run.encode,
        run.sampling,
        dynamic.round_tokens(rc.rollout_max_response_len),
        rc.n_samples_per_prompt,
        run.reward_fn,
        run.cfg.loop.seed,
    )

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
        rc.rollout_max_response_len,
        rollout_id,
    )


def sync_engine(run: Run) -> None:
    """Hand the trainer's weights to the engine; their version is the optimizer step."""
    if run.engine is not None:
        run.engine.update_weights(run.model, run.actor.step)


def prune_tool_journal(run: Run) -> None:
    """Drop the tool journal's entries that no rollout of this run can generate again: those of
    slots before the checkpoint it starts from (all of them on a fresh start)."""
    if run.agent is not None and env.is_main():
        run.agent.journal.prune(run.plan.start_rollout_id if run.plan.action == RESUME else 1 << 62)


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


def train(run: Run, progress: RunProgress) -> tuple[list[dict], str | None]:
    cfg, plan = run.cfg, run.plan
    start(run, progress)
    records = []

    stop_reason = None
    # under torchrun, the stop and sentinel answers below are agreed by all ranks
    with preemption_guard(cfg.loop.save_trigger_sentinel, cfg.loop.stop_grace_seconds) as preempt:
        for rollout_id in range(plan.start_rollout_id, plan.num_rollout):
            started = time.perf_counter()
            progress.phase(rollout_id, "generate")
            prompts, samples, sampling = draw_rollout(run, rollout_id)
            generated = time.perf_counter()
            fault_point("after_generate")

            progress.phase(rollout_id, "train")
            # the overlong penalty shapes the trained reward only: the filter, accuracy and
            # reward_mean see the task's own reward
            shaped = shape_rewards(samples, cfg.shaping, cfg.rollout.rollout_max_response_len)
            batch = pack_samples(shaped, run.tokenizer.pad_token_id).to(run.device)
            if cfg.shaping.overlong_buffer_len:
                sampling["overlong_reward_mean"] = float(batch.rewards.mean())
            if cfg.shaping.mask_truncated_completions:
                sampling["truncated_masked"] = mask_truncated(batch, samples)
            if cfg.dynamic.partial_rollout:  # tokens of older weights: continued partial answers
                version = run.actor.step
                sampling["partial_rollout/offpolicy_tokens"] = offpolicy_tokens(samples, version)
                if cfg.dynamic.mask_offpolicy_in_partial_rollout:
                    sampling["partial_rollout/offpolicy_masked"] = mask_offpolicy(
                        batch, samples, version
                    )
            mismatch = apply_mismatch(cfg.mismatch, run.engine, run.actor, batch)
            stats = {**train_rollout(run, rollout_id, batch), **mismatch, **sampling}
            run.actor.release_gradients()
            trained = time.perf_counter()
            sync_engine(run)
            synced = time.perf_counter()
            fault_point("after_train")

            record = rollout_record(
                rollout_id, prompts, samples, stats, (started, generated, trained, synced)
            )
            if cfg.eval.log_passrate:
                record |= rollout_passrate(samples, cfg.rollout.n_samples_per_prompt)
            evaluate_if_due(run, progress, record)
            stop_reason = log_and_save(run, progress, preempt, record, records, checkpoint_state)
            if stop_reason:
                break
        if run.writer is not None:
            run.writer.wait()
    finish(run, progress, records, stop_reason)
    return records, stop_reason


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
