"""Checkpoint and weight-source flags (miles names), and their translation to `StartFlags`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mileage.checkpoint.plan import StartFlags
from mileage.checkpoint.schedule import SaveSchedule, build_schedule
from mileage.config import option
from mileage.errors import UserError


@dataclass
class CheckpointConfig:
    hf_checkpoint: str | None = option(
        None,
        "Hugging Face model directory: architecture, tokenizer, and (bridge mode) initial weights",
    )
    megatron_to_hf_mode: str = option(
        "bridge",
        "bridge: a fresh run loads HF weights; raw: it loads a native checkpoint from --ref-load",
        choices=("bridge", "raw"),
    )
    load: str | None = option(
        None, "save directory to resume from (a missing one means a fresh start)"
    )
    save: str | None = option(None, "directory to write checkpoints and metrics into")
    ref_load: str | None = option(
        None, "reference-model weights (HF dir in bridge mode, native in raw)"
    )
    ref_ckpt_step: int | None = option(None, "iteration to take from --ref-load (raw mode)")
    ckpt_step: int | None = option(None, "load exactly iter_K from --load instead of the tracker's")
    finetune: bool = option(False, "take only the weights from --load; start at rollout 0")
    load_optim: bool = option(True, "do not restore the optimizer state", flag="--no-load-optim")
    load_rng: bool = option(True, "do not restore the global RNG states", flag="--no-load-rng")
    start_rollout_id: int | None = option(
        None, "first rollout id to run (overrides the checkpoint's)"
    )
    save_interval: int | None = option(
        None,
        "save every N rollouts (and always after the last one); default with --save: every "
        "tenth of the run or --save-interval-minutes of work, whichever comes first",
    )
    save_interval_minutes: float | None = option(
        None,
        "also save once this many minutes of work are unsaved (default 5 without "
        "--save-interval, off with it; 0: never by the clock)",
    )
    no_save: bool = option(
        False, "run without --save on purpose (no warning that a killed run starts over)"
    )
    save_keep_last: int | None = option(None, "keep only the newest K checkpoints (default: all)")
    async_save: bool = option(False, "write checkpoints in a background thread")
    save_hf: str | None = option(
        None, "also export HF weights to this path template ({rollout_id})"
    )

    def start_flags(self, hf_checkpoint: str, num_rollout: int) -> StartFlags:
        return StartFlags(
            hf_checkpoint=hf_checkpoint,
            num_rollout=num_rollout,
            mode=self.megatron_to_hf_mode,
            load=self.load,
            save=self.save,
            ref_load=self.ref_load,
            ref_ckpt_step=self.ref_ckpt_step,
            ckpt_step=self.ckpt_step,
            finetune=self.finetune,
            load_optim=self.load_optim,
            load_rng=self.load_rng,
            start_rollout_id=self.start_rollout_id,
        )

    def validate(self) -> None:
        if self.save == "":
            raise UserError("--save is empty: give a directory, or --no-save to save nothing")
        if self.save and self.no_save:
            raise UserError("--save and --no-save contradict each other: give one")
        if self.save_interval_minutes is not None and not (
            math.isfinite(self.save_interval_minutes) and self.save_interval_minutes >= 0
        ):
            raise UserError(
                f"--save-interval-minutes must be a number >= 0, got {self.save_interval_minutes}"
            )

    def schedule(
        self, num_rollout: int, agree: Callable[[bool], bool] = lambda due: due
    ) -> SaveSchedule:
        return build_schedule(num_rollout, self.save_interval, self.save_interval_minutes, agree)

    def schedule_line(self, num_rollout: int) -> str:
        """The plan's line on saving, or the warning that nothing is saved."""
        if self.save:
            return self.schedule(num_rollout).describe()
        if self.no_save:
            return "  saves: nothing (--no-save)"
        read = f"; --load {self.load} is only read" if self.load else ""
        return (
            f"  warning: no --save: this run saves nothing{read}, and a killed run starts over "
            "(--save DIR to save, --no-save to run without saving on purpose)"
        )
