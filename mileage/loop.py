"""The driver loop: the algorithm of a run, top to bottom.

for each rollout_id in [start_rollout_id, num_rollout):
    take the next prompts, sample n answers each with the current policy, score them,
    turn rewards into advantages and train the policy on them,
    log, save on schedule, hand the new weights to the generator, evaluate on schedule.
A SIGTERM/SIGINT or the sentinel file makes the current rollout the last one saved.
"""

from __future__ import annotations

import time

from mileage.components import Run, checkpoint_state, restore
from mileage.distributed import env
from mileage.distributed.coordination import preemption_guard
from mileage.faults import fault_point
from mileage.metrics import EVAL_BEFORE_TRAINING
from mileage.progress import RunProgress
from mileage.rollout.evaluation import evaluate, rollout_passrate, summary
from mileage.rollout.rollout import generate_samples, load_samples, save_samples
from mileage.training.batch import pack_samples
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
    )


def eval_due(run: Run, rollout_id: int) -> bool:
    interval = run.cfg.loop.eval_interval
    last = rollout_id == run.plan.num_rollout - 1
    return can_eval(run) and ((rollout_id + 1) % interval == 0 or last)


def rollout_samples(run: Run, rollout_id: int, prompts) -> list:
    rc = run.cfg.rollout
    if rc.load_debug_rollout_data:
        return load_samples(
            rc.load_debug_rollout_data, rollout_id, prompts, rc.n_samples_per_prompt
        )
    samples = generate_samples(
        run.engine,
        run.encode,
        prompts,
        run.sampling,
        rc.n_samples_per_prompt,
        run.reward_fn,
        run.cfg.loop.seed,
        rollout_id,
    )
    if rc.save_debug_rollout_data and env.is_main():
        save_samples(rc.save_debug_rollout_data, rollout_id, samples)
    return samples


def sync_engine(run: Run) -> None:
    """Hand the trainer's weights to the engine; their version is the optimizer step."""
    if run.engine is not None:
        run.engine.update_weights(run.model, run.actor.step)


def train(run: Run, progress: RunProgress) -> list[dict]:
    cfg, plan = run.cfg, run.plan
    restore(run, progress.print)
    sync_engine(run)  # a server may hold other weights than the ones just restored
    records = []
    if can_eval(run) and plan.start_rollout_id == 0 and not cfg.loop.skip_eval_before_train:
        # recorded as the point the held-out curve starts from (miles logs it at step 0)
        metrics = run_eval(run, EVAL_BEFORE_TRAINING)
        run.metrics.log({"rollout_id": EVAL_BEFORE_TRAINING, **metrics})
        progress.print(f"eval before training: {summary(metrics)}")

    stop_reason = None
    # under torchrun, the stop and sentinel answers below are agreed by all ranks
    with preemption_guard(cfg.loop.save_trigger_sentinel) as preempt:
        for rollout_id in range(plan.start_rollout_id, plan.num_rollout):
            started = time.perf_counter()
            progress.phase(rollout_id, "generate")
            prompts = run.data.next_batch(cfg.rollout.rollout_batch_size)
            fault_point("rollout_start")
            samples = rollout_samples(run, rollout_id, prompts)
            generated = time.perf_counter()
            fault_point("after_generate")

            progress.phase(rollout_id, "train")
            batch = pack_samples(samples, run.tokenizer.pad_token_id).to(run.device)
            mismatch = apply_mismatch(cfg.mismatch, run.engine, run.actor, batch)
            stats = {**run.actor.train_rollout(batch), **mismatch}
            trained = time.perf_counter()
            sync_engine(run)
            synced = time.perf_counter()
            fault_point("after_train")

            record = rollout_record(
                rollout_id, prompts, samples, stats, (started, generated, trained, synced)
            )
            if cfg.eval.log_passrate:
                record |= rollout_passrate(samples, cfg.rollout.n_samples_per_prompt)
            if eval_due(run, rollout_id):
                progress.phase(rollout_id, "eval")
                record |= run_eval(run, rollout_id)
            run.metrics.log(record)  # before the save: a resume cuts the log back to the checkpoint
            fault_point("after_metrics")

            # decided once: a signal arriving after this line stops (and saves) the next rollout
            if preempt.stop_requested:
                stop_reason = preempt.signal_name
            elif len(records) + 1 == cfg.loop.debug_exit_after_rollout:
                stop_reason = "--debug-exit-after-rollout"
            sentinel = preempt.sentinel_present()
            scheduled = cfg.checkpoint.should_save(rollout_id, plan.num_rollout)
            if run.writer is not None and (scheduled or sentinel or stop_reason):
                progress.phase(rollout_id, "save")
                run.writer.save(rollout_id, checkpoint_state(run, rollout_id))
                record["saved"] = True
            if sentinel:
                preempt.clear_sentinel()
            progress.done(record)
            records.append(record)

            if stop_reason:
                break
        if run.writer is not None:
            run.writer.wait()
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
    return records


def rollout_record(
    rollout_id: int, prompts, samples, stats: dict, times: tuple[float, float, float, float]
) -> dict:
    """One metrics.jsonl line; `times` are when the rollout started, generation and training
    ended, and the engine had the new weights."""
    started, generated, trained, synced = times
    rewards = [s.reward for s in samples]
    response_tokens = sum(len(s.response_ids) for s in samples)
    return {
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
