"""The dataset source (`mileage sft`): each rollout is the next `--rollout-batch-size` records of
the data, with their own answers as the samples (`mileage.rollout.sft`); nothing generates.

Everything else is the driver's: the batch is packed and trained (`--loss-type sft_loss`), the
checkpoint commits the weights, optimizer, RNG and the data position together, and a rerun
continues at the next record, bit for bit. The engine only evaluates (`--eval-interval`).
"""

from __future__ import annotations

from mileage.checkpoint.store import CheckpointState
from mileage.components import Run
from mileage.errors import UserError
from mileage.faults import fault_point
from mileage.rollout.sft import sft_sample
from mileage.rollout.sizes import context_length
from mileage.run_config import RunConfig
from mileage.sources import Drawn, sync_engine
from mileage.training.batch import TrainBatch

SFT_LOSS = "sft_loss"


def check_sft_loss(loss_type: str) -> None:
    if loss_type != SFT_LOSS:
        raise UserError(
            f"mileage sft trains --loss-type {SFT_LOSS} (the data's answers, no reward); "
            f"--loss-type {loss_type} is for `mileage train`"
        )


def check_sft_run(cfg: RunConfig) -> None:
    """What `mileage sft` refuses beyond `cross_checks.check_run`: the flags that say how samples
    are generated or how rewards become advantages, which a run of the data's own answers has
    none of (one line, exit 2)."""
    check_sft_loss(cfg.algo.loss_type)
    generation = [
        (flag, on)
        for flag, on in (
            ("--dynamic-sampling-filter-path", cfg.dynamic.enabled),
            ("--partial-rollout", cfg.dynamic.partial_rollout),
            ("--use-opd", cfg.opd.use_opd),
            ("--advantage-estimator ppo", cfg.algo.advantage_estimator == "ppo"),
            ("--load-debug-rollout-data", bool(cfg.rollout.load_debug_rollout_data)),
            ("--rollout-function-path", bool(cfg.multiturn.rollout_function_path)),
            ("--custom-generate-function-path", bool(cfg.multiturn.custom_generate_function_path)),
            ("--agent-function-path", bool(cfg.multiturn.agent_function_path)),
        )
        if on
    ]
    if generation:
        raise UserError(
            f"mileage sft trains on the data's own answers, nothing is sampled or scored: "
            f"{generation[0][0]} is for `mileage train`"
        )
    if cfg.rollout.n_samples_per_prompt != 1:
        raise UserError(
            "mileage sft trains each record's one answer: --n-samples-per-prompt must be 1"
        )


class DatasetSource:
    def __init__(self, run: Run):
        self.run = run
        self.eos_id = run.tokenizer.eos_token_id
        self.context = context_length(run.model_config)

    def start(self) -> None:
        """Nothing of its own: the data position is a registered part of the run."""

    def draw(self, rollout_id: int) -> Drawn:
        prompts = self.run.data.next_batch(self.run.cfg.rollout.rollout_batch_size)
        fault_point("rollout_start")
        samples = [sft_sample(p, self.run.encode, self.eos_id) for p in prompts]
        for s in samples:
            length = len(s.prompt_ids) + len(s.response_ids)
            if self.context and length > self.context:
                raise UserError(
                    f"SFT record {s.prompt.index} is {length} tokens, more than the model's "
                    f"context of {self.context}; shorten or drop it (nothing of this rollout was "
                    "trained or saved)"
                )
        trained = sum(sum(s.mask()) for s in samples)
        return Drawn(prompts, samples, {"sft_tokens": trained})

    def correct(self, batch: TrainBatch, drawn: Drawn, rollout_id: int) -> dict:
        return {}  # the samples are the data's: no weights made them

    def after_train(self, rollout_id: int, drawn: Drawn) -> tuple[bool, dict]:
        if self.run.engine is None:
            return False, {}
        sync_engine(self.run)  # only evaluation generates
        return True, {}

    def checkpoint(self, state: CheckpointState) -> CheckpointState:
        return state

    def close(self) -> None:
        pass
