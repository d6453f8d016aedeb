"""The driver loop: the algorithm of a run, top to bottom.

for each rollout_id in [start_rollout_id, num_rollout):
    take the next prompts, sample n answers each with the current policy, score them,
    turn rewards into advantages and train the policy on them,
    log, save on schedule, hand the new weights to the generator, evaluate on schedule.
"""

from __future__ import annotations

import time

from mileage.components import Run, checkpoint_state, restore
from mileage.progress import RunProgress
from mileage.rollout.rollout import evaluate, generate_samples
from mileage.training.batch import pack_samples


def run_eval(run: Run) -> float | None:
    if not run.eval_prompts:
        return None
    max_len = run.cfg.rollout.rollout_max_response_len
    return evaluate(run.engine, run.encode, run.eval_prompts, max_len, run.reward_fn)


def eval_due(run: Run, rollout_id: int) -> bool:
    interval = run.cfg.loop.eval_interval
    last = rollout_id == run.plan.num_rollout - 1
    return bool(interval) and ((rollout_id + 1) % interval == 0 or last)


def train(run: Run, progress: RunProgress) -> list[dict]:
    cfg, plan = run.cfg, run.plan
    restore(run, progress.print)
    records = []
    if (
        cfg.loop.eval_interval
        and plan.start_rollout_id == 0
        and not cfg.loop.skip_eval_before_train
    ):
        progress.print(f"eval before training: accuracy {run_eval(run):.3f}")

    for rollout_id in range(plan.start_rollout_id, plan.num_rollout):
        started = time.perf_counter()
        progress.phase(rollout_id, "generate")
        prompts = run.data.next_batch(cfg.rollout.rollout_batch_size)
        samples = generate_samples(
            run.engine,
            run.encode,
            prompts,
            run.sampling,
            cfg.rollout.n_samples_per_prompt,
            run.reward_fn,
            cfg.loop.seed,
            rollout_id,
        )
        generated = time.perf_counter()

        progress.phase(rollout_id, "train")
        stats = run.actor.train_rollout(pack_samples(samples, run.tokenizer.pad_token_id))
        run.engine.update_weights(run.model)
        trained = time.perf_counter()

        record = rollout_record(rollout_id, prompts, samples, stats, started, generated, trained)
        if eval_due(run, rollout_id):
            progress.phase(rollout_id, "eval")
            record["eval_accuracy"] = run_eval(run)
        run.metrics.log(record)  # before the save: a resume cuts the log back to the checkpoint

        if cfg.checkpoint.should_save(rollout_id, plan.num_rollout):
            progress.phase(rollout_id, "save")
            run.writer.save(rollout_id, checkpoint_state(run, rollout_id))
            record["saved"] = True
        progress.done(record)
        records.append(record)
        if len(records) == cfg.loop.debug_exit_after_rollout:
            progress.print(f"stopping after {len(records)} rollouts (--debug-exit-after-rollout)")
            break

    if run.writer is not None:
        run.writer.wait()
    run.metrics.close()
    return records


def rollout_record(
    rollout_id: int, prompts, samples, stats: dict, started: float, generated: float, trained: float
) -> dict:
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
        "step_time": trained - started,
    }
