"""What a run trains, recorded in each checkpoint: RL (`mileage train`, `train-async`) or SFT
(`mileage sft`). A checkpoint of the other stage is a starting point, never a resume: its
optimizer, RNG and data position belong to other training (`other_stage`, called by
`plan.plan_start`). Only SFT checkpoints carry the key, so RL checkpoints stay as they were.
"""

from __future__ import annotations

from mileage.checkpoint.layout import CheckpointInfo
from mileage.checkpoint.sources import Source, native_source

STAGE = "stage"  # meta.json's key
RL, SFT = "rl", "sft"


def recorded_stage(info: CheckpointInfo | None) -> str:
    return info.meta.get(STAGE, RL) if info is not None else RL


def stage_meta(stage: str) -> dict:
    """What meta.json records of `stage` (nothing for RL)."""
    return {STAGE: stage} if stage != RL else {}


def other_stage(
    source: Source, stage: str, wanted: str, save, reasons: list[str]
) -> tuple[Source, bool]:
    """(where the run's weights come from, whether it resumes) when --load names a checkpoint of
    stage `stage` and the run trains `wanted`: from its weights with a fresh optimizer, RNG and
    data position, as miles' --finetune. Rerun, the same command finds this run's own checkpoints
    in --save (`save`, another directory's DirState) and resumes them."""
    if save is not None and save.tracker.exists and save.tracker.valid and save.path != source.path:
        own = native_source(save, None, "--ckpt-step")
        if recorded_stage(own.info) == wanted:
            reasons.append(
                f"--save {save.path} holds this {wanted.upper()} run's checkpoints, started from "
                f"the {stage.upper()} checkpoint --load names: resuming them ({own.reason})"
            )
            return own, own.iteration is not None
    reasons.append(
        f"{source.path} is an {stage.upper()} checkpoint: {wanted.upper()} starts from its "
        "weights with a fresh optimizer, RNG and data position (as --finetune)"
    )
    return source, False
