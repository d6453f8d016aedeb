"""The whole run's configuration: one typed section per part, each declared beside its code."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from mileage.checkpoint.config import CheckpointConfig
from mileage.config import add_options, from_namespace, option
from mileage.errors import UserError
from mileage.rollout.data import DataConfig
from mileage.rollout.rewards import RewardConfig
from mileage.rollout.rollout import RolloutConfig
from mileage.tracking import TrackingConfig
from mileage.training.actor import AlgoConfig
from mileage.training.optimizer import OptimConfig

DEFAULT_NUM_ROLLOUT = 150


@dataclass
class LoopConfig:
    num_rollout: int | None = option(
        None, f"rollouts to run in total (default {DEFAULT_NUM_ROLLOUT})"
    )
    num_epoch: int | None = option(None, "alternatively: passes over the prompt data")
    seed: int = option(1234, "seed for sampling, shuffling and initialisation")
    eval_interval: int | None = option(25, "evaluate every N rollouts (0 disables)")
    skip_eval_before_train: bool = option(False, "do not evaluate before the first rollout")
    num_threads: int = option(
        min(2, os.cpu_count() or 1), "torch CPU threads (fixed, so results are reproducible)"
    )
    save_trigger_sentinel: str | None = option(
        None, "if this file exists at the end of a rollout: save, then delete it"
    )
    debug_exit_after_rollout: int | None = option(
        None, "stop (exit 0) after this many rollouts in this process, as if preempted"
    )


SECTIONS = (
    ("checkpoint", CheckpointConfig, "checkpoints and weights"),
    ("data", DataConfig, "data"),
    ("rollout", RolloutConfig, "rollout"),
    ("reward", RewardConfig, "reward"),
    ("algo", AlgoConfig, "algorithm"),
    ("optim", OptimConfig, "optimizer"),
    ("loop", LoopConfig, "loop"),
    ("tracking", TrackingConfig, "tracking"),
)


@dataclass
class RunConfig:
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        for _, cls, title in SECTIONS:
            add_options(parser, cls, title)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RunConfig:
        cfg = cls(**{name: from_namespace(section, ns) for name, section, _ in SECTIONS})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        r = self.rollout
        positive = {
            "--rollout-batch-size": r.rollout_batch_size,
            "--n-samples-per-prompt": r.n_samples_per_prompt,
            "--rollout-max-response-len": r.rollout_max_response_len,
            "--num-threads": self.loop.num_threads,
        }
        optional_positive = {
            "--num-rollout": self.loop.num_rollout,
            "--num-epoch": self.loop.num_epoch,
            "--save-interval": self.checkpoint.save_interval,
            "--save-keep-last": self.checkpoint.save_keep_last,
            "--global-batch-size": self.algo.global_batch_size,
            "--micro-batch-size": self.algo.micro_batch_size,
        }
        for flag, value in {
            **positive,
            **{k: v for k, v in optional_positive.items() if v is not None},
        }.items():
            if value <= 0:
                raise UserError(f"{flag} must be positive, got {value}")
        if self.loop.num_rollout is not None and self.loop.num_epoch is not None:
            raise UserError("give --num-rollout or --num-epoch, not both")
        if not 0.0 < r.rollout_top_p <= 1.0:
            raise UserError(f"--rollout-top-p must be in (0, 1], got {r.rollout_top_p}")
        if r.rollout_temperature < 0:
            raise UserError(f"--rollout-temperature must be >= 0, got {r.rollout_temperature}")
        for flag, value in (
            ("--start-rollout-id", self.checkpoint.start_rollout_id),
            ("--ckpt-step", self.checkpoint.ckpt_step),
        ):
            if value is not None and value < 0:
                raise UserError(f"{flag} must be >= 0, got {value}")
        if self.algo.advantage_estimator == "grpo" and r.n_samples_per_prompt < 2:
            raise UserError(
                "grpo needs --n-samples-per-prompt >= 2 (advantages are relative to the group)"
            )
        self.algo.batch_sizes(r.samples_per_rollout)

    def num_rollout(self, num_prompts: int) -> int:
        if self.loop.num_rollout is not None:
            return self.loop.num_rollout
        if self.loop.num_epoch is not None:
            return max(1, self.loop.num_epoch * num_prompts // self.rollout.rollout_batch_size)
        return DEFAULT_NUM_ROLLOUT
