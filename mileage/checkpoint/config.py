"""Checkpoint and weight-source flags (miles names), and their translation to `StartFlags`."""

from __future__ import annotations

from dataclasses import dataclass

from mileage.checkpoint.plan import StartFlags
from mileage.config import option


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
        None, "save every N rollouts (and always after the last one)"
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

    def should_save(self, rollout_id: int, num_rollout: int) -> bool:
        if not self.save:
            return False
        last = rollout_id == num_rollout - 1
        return last or (
            self.save_interval is not None and (rollout_id + 1) % self.save_interval == 0
        )
