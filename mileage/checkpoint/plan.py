"""The resume decision: a pure function from flags plus disk state to a `ResumePlan`.

`plan_start(flags, disk)` reads nothing itself: `gather_disk_state` takes the snapshot, so every
rule below is testable by building directories (or `DirState`s) and calling it. This table is
the contract; each row has a test in tests/test_plan.py.

| on disk / flags                                   | decision                                                  |
|---------------------------------------------------|-----------------------------------------------------------|
| --load unset, missing, or without checkpoints     | fresh from the mode's source; start at --start-rollout-id or 0 |
| --load without a tracker, holding complete iter_N | resume from the newest complete one (restore verifies it), said in the plan |
| tracker N and iter_N complete                     | resume from iter_N: weights, optimizer, RNG, data; start N+1 |
| tracker "release"                                 | fresh from release/ weights; start 0; no optimizer/RNG/data |
| --ckpt-step K                                     | iter_K exactly (K=0 too); error if absent or incomplete   |
| --finetune                                        | weights only from the checkpoint; start 0, fresh optimizer/RNG/data |
| --no-load-optim / --no-load-rng                   | skip that part of a resume                                |
| --start-rollout-id S on a resume                  | S wins; a warning when S != N+1                           |
| tracker invalid, or naming a missing/incomplete dir | error (exit 2) naming the file, its text, the complete checkpoints |
| start == num_rollout                              | action "complete": nothing to train, exit 0               |
| start > num_rollout                               | error explaining the numbers                              |
| checkpoint model config != --hf-checkpoint config | error naming the differing fields                         |
| --save holds committed checkpoints (a tracker) this start won't continue | error: suggest --load SAVE or a new --save |
| --save holds complete iter_N without a tracker, not continued | error: the same (never overwrite a complete checkpoint) |
| resume from iter_K older than complete iter_N in --save | resume; the plan says this run writes over iter_N |
| resume with other trajectory settings (--seed, ...) | resume; the plan names each changed setting |
| mode bridge + native source / mode raw + HF source | error naming the mode that fits                          |
| resume saved at another world size (torchrun N)   | resume (DCP reshards); the plan says what stays exact     |
| resume saved in another precision (fp32/bf16)     | resume; the plan says what stays exact                    |
| PPO resume: the checkpoint has no critic/         | error: suggest --finetune (fresh critic) or another --load |
| PPO resume: critic/ saved at another rollout      | error: the critic is behind (or ahead of) the actor       |
| PPO: critic (checkpoint or --critic-load) from another model | error naming the differing fields              |
| PPO resume                                        | critic weights, optimizer and counters from the checkpoint's critic/ |
| PPO fresh/--finetune                              | critic weights from --critic-load, else the checkpoint's critic/ (finetune), else the actor's weights + a fresh value head |
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from mileage.checkpoint.critic_plan import plan_critic
from mileage.checkpoint.layout import (
    CRITIC_DIR,
    TRACKER,
    CheckpointInfo,
    DirState,
    config_differences,
    scan_dir,
)
from mileage.checkpoint.sources import Source, bad_tracker, list_complete, native_source
from mileage.checkpoint.stages import RL, SFT, other_stage, recorded_stage
from mileage.errors import UserError

FRESH, RESUME, COMPLETE = "fresh", "resume", "complete"


@dataclass(frozen=True)
class StartFlags:
    hf_checkpoint: str
    num_rollout: int
    mode: str = "bridge"
    load: str | None = None
    save: str | None = None
    ref_load: str | None = None
    ref_ckpt_step: int | None = None
    ckpt_step: int | None = None
    finetune: bool = False
    load_optim: bool = True
    load_rng: bool = True
    start_rollout_id: int | None = None
    world_size: int = 1  # processes of this run (torchrun --nproc-per-node x --nnodes)
    critic: bool = False  # --advantage-estimator ppo: the run trains a critic
    critic_load: str | None = None
    precision: str = "fp32"  # the resolved compute precision (mileage.precision)
    precision_note: str = ""  # why: auto's evidence, or "as asked"
    # (flag, value) of the settings that decide the trajectory (recorded in meta.json): a
    # resume that changes one goes ahead, and the plan says the run leaves the saved one's path
    settings: tuple[tuple[str, object], ...] = ()
    # what the run trains (`mileage.checkpoint.stages`); a checkpoint of the other stage starts
    # this one from its weights, as --finetune does
    stage: str = RL


@dataclass(frozen=True)
class DiskState:
    load: DirState | None
    save: DirState | None
    ref_load: DirState | None
    hf_checkpoint: DirState | None
    model_config: dict | None  # the config the run builds its model from (the --hf-checkpoint one)
    critic_load: DirState | None = None


def gather_disk_state(flags: StartFlags, model_config: dict | None) -> DiskState:
    return DiskState(
        load=scan_dir(flags.load),
        save=scan_dir(flags.save),
        ref_load=scan_dir(flags.ref_load),
        hf_checkpoint=scan_dir(flags.hf_checkpoint),
        model_config=model_config,
        critic_load=scan_dir(flags.critic_load),
    )


@dataclass(frozen=True)
class ResumePlan:
    action: str
    mode: str
    weights_from: str
    weights_format: str  # "hf" or "native"
    iteration: int | None
    start_rollout_id: int
    num_rollout: int
    load_optimizer: bool
    load_rng: bool
    load_data_state: bool
    reasons: tuple[str, ...]
    # PPO: the checkpoint directory whose critic/ the critic loads; None: the actor's weights
    # and a fresh value head. critic_state: also its optimizer and counters (a resume)
    critic: bool = False
    critic_from: str | None = None
    critic_state: bool = False
    precision: str = "fp32"
    precision_note: str = ""
    # the micro-batch training uses (`mileage.training.memory.plan_memory`), and the memory
    # estimate behind it; what is free changes from one call to the next, so it is not part
    # of the decision a replanning compares
    micro_batch: int | None = None
    memory: dict | None = field(default=None, compare=False)
    memory_line: str = field(default="", compare=False)
    stage: str = RL  # recorded in each checkpoint's meta.json (StartFlags.stage)
    # --use-opd: the teacher's weights (path, "hf" or "native"), verified with the rest, and
    # what its term adds to the advantage
    teacher_from: str | None = None
    teacher_format: str | None = None
    teacher_line: str = field(default="", compare=False)
    # a reward that says how it decides (the LLM judge: where, which model, what scale)
    reward_line: str = field(default="", compare=False)

    def to_json(self) -> str:
        data = asdict(self)
        data["reasons"] = list(self.reasons)
        del data["memory_line"], data["teacher_line"], data["reward_line"]
        if self.stage == RL:  # only `mileage sft` plans say what they train
            del data["stage"]
        if self.teacher_from is None:  # the teacher's part only appears with --use-opd
            del data["teacher_from"], data["teacher_format"]
        if not self.critic:  # the critic's part of the plan only appears for PPO
            for key in ("critic", "critic_from", "critic_state"):
                del data[key]
        return json.dumps(data, indent=2)

    def describe(self) -> str:
        what = {
            FRESH: f"fresh start at rollout {self.start_rollout_id}",
            RESUME: f"resume at rollout {self.start_rollout_id}",
            COMPLETE: "nothing to do",
        }[self.action]
        loads = [
            n
            for n, on in (
                ("optimizer", self.load_optimizer),
                ("rng", self.load_rng),
                ("data position", self.load_data_state),
            )
            if on
        ]
        lines = [
            f"plan: {what} of {self.num_rollout} ({self.mode} mode)",
            f"  weights: {self.weights_from} ({self.weights_format}"
            + (f", iteration {self.iteration})" if self.iteration is not None else ")"),
            f"  also loads: {', '.join(loads) if loads else 'nothing else (fresh optimizer, RNG, data)'}",
            f"  precision: {self.precision}"
            + (" compute, fp32 master weights" if self.precision != "fp32" else "")
            + (f" ({self.precision_note})" if self.precision_note else ""),
        ]
        if self.memory_line:
            lines.append(f"  {self.memory_line}")
        if self.teacher_line:
            lines.append(f"  {self.teacher_line}")
        if self.reward_line:
            lines.append(f"  {self.reward_line}")
        if self.critic:
            lines.append(
                "  critic: "
                + (
                    "the actor's starting weights + a fresh value head"
                    if self.critic_from is None
                    else os.path.join(self.critic_from, CRITIC_DIR)
                    + (" (weights, optimizer, counters)" if self.critic_state else " (weights)")
                )
            )
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def _fresh_source(flags: StartFlags, disk: DiskState) -> Source:
    """Where a fresh run's weights come from in the chosen mode (also the reference model's)."""
    if flags.mode == "bridge":
        flag, state = (
            ("--ref-load", disk.ref_load)
            if flags.ref_load
            else ("--hf-checkpoint", disk.hf_checkpoint)
        )
        if state is None or not state.exists:
            raise UserError(f"{flag} {state.path if state else None} does not exist")
        if state.is_native and not state.is_hf:
            raise UserError(
                f"{flag} {state.path} is a native mileage checkpoint directory; bridge mode needs a "
                f"Hugging Face model directory: use --megatron-to-hf-mode raw --ref-load {state.path}"
            )
        if not state.is_hf:
            raise UserError(
                f"{flag} {state.path} is not a Hugging Face model (needs config.json and weights)"
            )
        return Source(
            state.path, "hf", None, None, f"bridge mode: weights from {flag} {state.path}"
        )
    if not flags.ref_load:
        raise UserError(
            "raw mode needs --ref-load DIR (a native checkpoint, e.g. from `mileage convert`)"
        )
    state = disk.ref_load
    if not state.exists:
        raise UserError(f"--ref-load {state.path} does not exist")
    if state.is_hf and not state.is_native:
        raise UserError(
            f"--ref-load {state.path} is a Hugging Face model directory; raw mode needs a native "
            f"checkpoint: use --megatron-to-hf-mode bridge, or `mileage convert` it first"
        )
    source = native_source(state, flags.ref_ckpt_step, "--ref-ckpt-step")
    return Source(
        source.path, source.fmt, source.iteration, source.info, f"raw mode: {source.reason}"
    )


def reference_source(flags: StartFlags, disk: DiskState) -> tuple[str, str]:
    """(path, format) of the frozen reference model: always the mode's fresh source, never --ckpt-step."""
    source = _fresh_source(flags, disk)
    return source.path, source.fmt


def _check_model_config(info: CheckpointInfo | None, disk: DiskState, path: str) -> None:
    if info is None or disk.model_config is None or "model_config" not in info.meta:
        return
    diffs = config_differences(info.meta["model_config"], disk.model_config)
    if diffs:
        raise UserError(
            f"{path} was saved for a different model than --hf-checkpoint ({'; '.join(diffs)})"
        )


def _world_size_change(info: CheckpointInfo | None, world_size: int) -> list[str]:
    saved = (info.meta if info is not None else {}).get("world_size", 1)
    if saved == world_size:
        return []
    return [
        f"world size changed: saved by {saved} process(es), resuming with {world_size}. Weights, "
        "optimizer state, rollout id, data position and LR continue exactly (DCP reshards the "
        "tensors); the rollouts after it are not bit-identical to a run that stayed at "
        f"{saved}: gradients are summed over ranks in another order and generation is batched "
        "differently"
    ]


def _precision_change(info: CheckpointInfo | None, precision: str) -> list[str]:
    # checkpoints from before the record were all written by fp32 runs
    saved = (info.meta if info is not None else {}).get("precision", "fp32")
    if saved == precision:
        return []
    return [
        f"precision changed: saved by a {saved} run, resuming in {precision}. Weights, optimizer "
        "state (both fp32), rollout id, data position and LR continue exactly; the rollouts "
        f"after it are not bit-identical to a run that stayed in {saved}: forward, backward and "
        "generation round differently"
    ]


def _settings_change(info: CheckpointInfo | None, settings: tuple) -> list[str]:
    saved = (info.meta if info is not None else {}).get("settings", {})
    changed = [
        f"{flag} {saved[flag]} -> {value}"
        for flag, value in settings
        if flag in saved and saved[flag] != value
    ]
    if not changed:
        return []
    return [
        f"settings changed since the checkpoint: {'; '.join(changed)}. Weights, optimizer state "
        "and data position continue; the rollouts after it follow the new settings, not the "
        "saved run's"
    ]


def plan_start(flags: StartFlags, disk: DiskState) -> ResumePlan:
    """Decide how this run starts. Raises UserError for every state it refuses."""
    reasons: list[str] = []
    load = disk.load
    other = None  # the stage of a checkpoint of the other stage that --load names
    if flags.ckpt_step is not None and flags.load is None:
        raise UserError("--ckpt-step selects a checkpoint under --load; --load is not set")
    if load is not None and load.exists and load.is_hf and not load.is_native:
        raise UserError(
            f"--load {load.path} is a Hugging Face model directory, not a save directory; "
            f"pass it as --hf-checkpoint (bridge mode)"
        )

    # torchtitan's latest-complete discovery: the tracker moves after a checkpoint is
    # committed, so it is missing when deleted or when a kill came between the two; a fresh
    # start would then write over complete checkpoints
    discovered = (
        load.complete_ids[-1]
        if load is not None
        and load.exists
        and not load.tracker.exists
        and flags.ckpt_step is None
        and load.complete_ids
        else None
    )
    has_checkpoint = (
        load is not None and load.exists and (load.tracker.exists or flags.ckpt_step is not None)
    ) or discovered is not None
    if has_checkpoint:
        if flags.ckpt_step is None and load.tracker.exists and not load.tracker.valid:
            bad_tracker(load)
        step = flags.ckpt_step if discovered is None else discovered
        source = native_source(load, step, "--ckpt-step")
        if discovered is not None:
            source = replace(
                source,
                reason=f"{load.path} has no {TRACKER}: resuming from its newest complete "
                f"checkpoint iter_{discovered:07d} (complete: {list_complete(load)}; "
                f"--ckpt-step K picks another)",
            )
        reasons.append(source.reason)
        resumable = source.iteration is not None and not flags.finetune
        stage = recorded_stage(source.info)
        if stage != flags.stage and not flags.finetune:
            other = stage
            source, resumable = other_stage(source, stage, flags.stage, disk.save, reasons)
        if source.iteration is None:
            reasons.append(
                "a release checkpoint holds weights only: nothing to resume, start fresh"
            )
        elif flags.finetune:
            reasons.append("--finetune: weights only; fresh optimizer, RNG and data position")
    else:
        if flags.load is None:
            reasons.append("--load is not set")
        elif not load.exists:
            reasons.append(f"--load {flags.load} does not exist yet")
        else:
            reasons.append(f"--load {flags.load} has no {TRACKER}")
        source = _fresh_source(flags, disk)
        reasons.append(source.reason)
        resumable = False
    _check_model_config(source.info, disk, source.path)

    if resumable:
        action, natural_start = RESUME, source.iteration + 1
        load_optim, load_rng, load_data = flags.load_optim, flags.load_rng, True
        if not flags.load_optim:
            reasons.append(
                "--no-load-optim: fresh optimizer state (the step counter still continues)"
            )
        if not flags.load_rng:
            reasons.append("--no-load-rng: global RNG states not restored")
        reasons += _world_size_change(source.info, flags.world_size)
        reasons += _precision_change(source.info, flags.precision)
        reasons += _settings_change(source.info, flags.settings)
    else:
        action, natural_start = FRESH, 0
        load_optim = load_rng = load_data = False

    start = natural_start
    if flags.start_rollout_id is not None:
        start = flags.start_rollout_id
        if action == RESUME and start != natural_start:
            reasons.append(
                f"warning: --start-rollout-id {start} overrides the checkpoint's next rollout {natural_start}"
            )
        else:
            reasons.append(f"--start-rollout-id {start}")

    if start == flags.num_rollout:
        reasons.append(f"run already complete ({start} of {flags.num_rollout} rollouts)")
        action = COMPLETE
    elif start > flags.num_rollout:
        raise UserError(
            f"this run would start at rollout {start} but --num-rollout is {flags.num_rollout}: nothing "
            f"would train. Raise --num-rollout (or --num-epoch) above {start - 1} to continue"
        )
    elif disk.save is not None and (
        (disk.save.tracker.exists and not disk.save.tracker.release) or disk.save.complete_ids
    ):
        # complete checkpoints, tracked or not (a release is weights only): a start that does
        # not continue them would write over them
        in_save = os.path.realpath(source.path).startswith(
            os.path.realpath(disk.save.path) + os.sep
        )
        continues_save = action == RESUME and in_save
        if not continues_save and other is not None and in_save:
            raise UserError(
                f"--save {disk.save.path} holds {other.upper()} checkpoints: `mileage "
                f"{'sft' if other == SFT else 'train'}` continues them; to start "
                f"{flags.stage.upper()} from them, keep --load {disk.save.path} and pass another "
                "--save"
            )
        if not continues_save:
            raise UserError(
                f"--save {disk.save.path} already holds checkpoints ({list_complete(disk.save)} complete) "
                f"that this start would not continue; pass --load {disk.save.path} to resume them, or "
                f"choose a new --save"
            )
        newer = [i for i in disk.save.complete_ids if i >= start]
        if newer:
            reasons.append(
                f"warning: {disk.save.path} holds newer checkpoints ({', '.join(map(str, newer))}) "
                f"than the one resumed: this run writes over each as it reaches its rollout"
            )

    critic_from = None
    if flags.critic:
        critic_load = None
        if flags.critic_load:  # a DiskState built by hand may lack it: then it does not exist
            critic_load = disk.critic_load or DirState(flags.critic_load, exists=False)
        critic_from = plan_critic(critic_load, disk.model_config, source, resumable, reasons)
    return ResumePlan(
        action=action,
        mode=flags.mode,
        weights_from=source.path,
        weights_format=source.fmt,
        iteration=source.iteration,
        start_rollout_id=start,
        num_rollout=flags.num_rollout,
        load_optimizer=load_optim,
        load_rng=load_rng,
        load_data_state=load_data,
        reasons=tuple(reasons),
        critic=flags.critic,
        critic_from=critic_from,
        critic_state=flags.critic and resumable,
        stage=flags.stage,
        precision=flags.precision,
        precision_note=flags.precision_note,
    )
