"""The whole run's configuration: one typed section per part, each declared beside its code."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from mileage.async_config import AsyncConfig
from mileage.checkpoint.config import CheckpointConfig
from mileage.config import add_options, flag_of, from_namespace, option
from mileage.cross_checks import check_async, check_run
from mileage.distributed.parallelize import ParallelConfig
from mileage.models.lora import LoraConfig
from mileage.precision import PrecisionConfig
from mileage.rollout import tool_task
from mileage.rollout.data import DataConfig
from mileage.rollout.dynamic import DynamicSamplingConfig
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.evaluation import EvalConfig
from mileage.rollout.multiturn import MultiTurnConfig
from mileage.rollout.rewards import RewardConfig
from mileage.rollout.rollout import RolloutConfig
from mileage.rollout.shaping import ShapingConfig
from mileage.rollout.userfn import HookConfig
from mileage.tracking import TrackingConfig
from mileage.training.actor import AlgoConfig
from mileage.training.critic import CriticConfig
from mileage.training.distill import OpdConfig
from mileage.training.finite import FiniteConfig
from mileage.training.mismatch import MismatchConfig
from mileage.training.optimizer import OptimConfig

DEFAULT_NUM_ROLLOUT = 150

# The built-in demo's own values. Every flag with a miles name has miles' default (docs/flags.md);
# miles' optimizer defaults (lr 1e-6, AdamW beta2 0.999, weight decay 0.01, linear decay to 0)
# are for fine-tuning billion-parameter models and leave the ~3M built-in model where it starts
# within the demo's 150 rollouts, and the README's measured accuracy is for a token-mean loss.
# Applied only when neither --prompt-data nor --hf-checkpoint is given, and only to the flags of
# this list that were not given; the plan prints which defaults these flags took, demo's or miles'.
DEMO_DEFAULTS = {
    "lr": 1e-4,
    "adam_beta2": 0.98,
    "weight_decay": 0.0,
    "lr_decay_style": "constant",
    "calculate_per_token_loss": True,
}
# A built-in task's own flags: what its prompts need to be answered at all (`addition-tool` turns
# on the tool loop with its calculator). Applied whenever that task supplies the prompts (no
# --prompt-data), and only to the flags not given.
TASK_DEFAULTS = {tool_task.TASK: tool_task.RUN_DEFAULTS}
# every flag some task sets (marked NotGiven in the parser, so a given one is never overridden)
# a task's defaults that an --agent-function-path run does not take (the agent runs the tools)
AGENT_REPLACES = ("generate_execute_tool_function_path", "generate_max_turns")
TASK_DEFAULTS_ALL = sorted({name for flags in TASK_DEFAULTS.values() for name in flags})


def flag_values(values: dict) -> str:
    """`--lr 1e-06 --calculate-per-token-loss`: flags as the user would give them."""
    return " ".join(
        f"--{name.replace('_', '-')}"
        if value is True
        else f"without --{name.replace('_', '-')}"
        if value is False
        else f"--{name.replace('_', '-')} {value}"
        for name, value in values.items()
    )


class NotGiven:
    """A flag's default in the parsed namespace, marking that the user did not give the flag."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    __str__ = __repr__


def _apply_demo_defaults(ns: argparse.Namespace) -> tuple[dict, dict]:
    """Resolve NotGiven markers: the demo's value for the built-in demo, the flag's otherwise;
    then the built-in task's own flags when it supplies the prompts. Returns the values the
    demo or task applied, and the DEMO_DEFAULTS flags that kept miles' default instead."""
    builtin_prompts = getattr(ns, "prompt_data", None) is None
    demo = builtin_prompts and getattr(ns, "hf_checkpoint", None) is None
    task = TASK_DEFAULTS.get(getattr(ns, "builtin_task", None), {}) if builtin_prompts else {}
    applied, kept = {}, {}
    for name, demo_value in DEMO_DEFAULTS.items():
        value = getattr(ns, name, None)
        if isinstance(value, NotGiven):
            setattr(ns, name, demo_value if demo else value.value)
            if demo:
                applied[name] = demo_value
            else:
                kept[name] = value.value
    if getattr(ns, "agent_function_path", None):
        # the agent calls the task's tool itself: the built-in tool loop is not the run's
        task = {k: v for k, v in task.items() if k not in AGENT_REPLACES}
    for name in TASK_DEFAULTS_ALL:
        value = getattr(ns, name, None)
        if isinstance(value, NotGiven):
            setattr(ns, name, task.get(name, value.value))
            if name in task:
                applied[name] = task[name]
    return applied, kept


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
    stop_grace_seconds: float = option(
        900.0,
        "after a SIGTERM/SIGINT, wait at most this long for the rollout in flight to finish and "
        "save; past it, exit 75 without it (0: wait however long it takes)",
    )


SECTIONS = (
    ("checkpoint", CheckpointConfig, "checkpoints and weights"),
    ("data", DataConfig, "data"),
    ("rollout", RolloutConfig, "rollout"),
    ("engine", EngineConfig, "rollout engine"),
    ("mismatch", MismatchConfig, "engine/trainer log-prob mismatch"),
    ("multiturn", MultiTurnConfig, "multi-turn and tool-using rollouts (docs/multiturn.md)"),
    ("reward", RewardConfig, "reward"),
    ("hooks", HookConfig, "user functions (timeouts)"),
    ("dynamic", DynamicSamplingConfig, "dynamic sampling (DAPO)"),
    ("shaping", ShapingConfig, "overlong shaping and truncation masking"),
    ("algo", AlgoConfig, "algorithm"),
    ("critic", CriticConfig, "PPO critic"),
    ("opd", OpdConfig, "on-policy distillation (docs/distillation.md)"),
    ("optim", OptimConfig, "optimizer"),
    ("finite", FiniteConfig, "non-finite values (NaN/inf in a loss, gradient or weight)"),
    ("lora", LoraConfig, "LoRA (PEFT)"),
    ("loop", LoopConfig, "loop"),
    ("eval", EvalConfig, "evaluation"),
    ("parallel", ParallelConfig, "device and distributed (torchrun)"),
    ("precision", PrecisionConfig, "precision"),
    ("tracking", TrackingConfig, "tracking"),
)


@dataclass
class RunConfig:
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    hooks: HookConfig = field(default_factory=HookConfig)
    dynamic: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    opd: OpdConfig = field(default_factory=OpdConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    finite: FiniteConfig = field(default_factory=FiniteConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # `mileage train-async` only (and `plan`, which plans for either); defaults elsewhere
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    # the DEMO_DEFAULTS this run took (empty unless it is the built-in demo) and the task's
    demo_defaults: dict = field(default_factory=dict)
    # the DEMO_DEFAULTS flags that kept miles' defaults (not given, and not the built-in demo)
    miles_defaults: dict = field(default_factory=dict)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, asynchronous: bool = False) -> None:
        for _, cls, title in SECTIONS:
            add_options(parser, cls, title)
        if asynchronous:
            add_options(parser, AsyncConfig, "async training (train-async)")
        marked = [*DEMO_DEFAULTS, *TASK_DEFAULTS_ALL]
        parser.set_defaults(**{name: NotGiven(parser.get_default(name)) for name in marked})

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RunConfig:
        ns = argparse.Namespace(**vars(ns))
        applied, kept = _apply_demo_defaults(ns)
        cfg = cls(**{name: from_namespace(section, ns) for name, section, _ in SECTIONS})
        cfg.asynchronous = from_namespace(AsyncConfig, ns)
        cfg.demo_defaults, cfg.miles_defaults = applied, kept
        cfg.validate()
        return cfg

    def demo_note(self) -> str | None:
        """One line naming where the values of the flags the demo has its own defaults for
        came from, when not given: the built-in demo's, or miles' (with --prompt-data or
        --hf-checkpoint the demo's do not apply, and miles' lr is 100x smaller); and a built-in
        task's own flags. None when the user gave every such flag."""
        demo = {n: v for n, v in self.demo_defaults.items() if n in DEMO_DEFAULTS}
        task = {n: v for n, v in self.demo_defaults.items() if n not in DEMO_DEFAULTS}
        parts = []
        if demo:
            parts.append(f"the built-in demo's {flag_values(demo)}")
        if self.miles_defaults:
            parts.append(
                f"miles' {flag_values(self.miles_defaults)} (the built-in demo's own apply "
                "only without --prompt-data and --hf-checkpoint)"
            )
        if task:
            parts.append(f"built-in task {self.data.builtin_task}'s {flag_values(task)}")
        return "defaults: " + "; ".join(parts) if parts else None

    # the settings that decide what a run samples and learns: meta.json records them, and a
    # resume that changes one is named in the plan (it goes ahead: a change can be deliberate)
    TRAJECTORY = (
        ("loop", "seed"),
        ("rollout", "rollout_batch_size"),
        ("rollout", "n_samples_per_prompt"),
        ("rollout", "rollout_max_response_len"),
        ("rollout", "rollout_temperature"),
        ("optim", "lr"),
    )

    def trajectory_settings(self) -> tuple[tuple[str, object], ...]:
        """(flag, value) of each TRAJECTORY setting of this run."""
        return (
            tuple(
                (flag_of(type(getattr(self, section)), name), getattr(getattr(self, section), name))
                for section, name in self.TRAJECTORY
            )
            + self.opd.settings()
        )

    def validate(self) -> None:
        """The checks of every part and across them (`mileage.cross_checks`)."""
        check_run(self)

    def validate_async(self) -> None:
        """What `mileage train-async` refuses beyond `validate`."""
        check_async(self)

    def num_rollout(self, num_prompts: int) -> int:
        if self.loop.num_rollout is not None:
            return self.loop.num_rollout
        if self.loop.num_epoch is not None:
            return max(1, self.loop.num_epoch * num_prompts // self.rollout.rollout_batch_size)
        return DEFAULT_NUM_ROLLOUT
