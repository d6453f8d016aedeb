"""Preflight: everything that can fail on user input, loaded and checked before anything is
written, and the resume plan made from it (cheap: JSON and directory listings, no tensors)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from mileage import ranks
from mileage.checkpoint.layout import META, DirState
from mileage.checkpoint.meta import (
    recorded_micro_batch,
    recorded_model_dir,
    recorded_source,
    selected_checkpoint,
)
from mileage.checkpoint.plan import (
    COMPLETE,
    RESUME,
    ResumePlan,
    StartFlags,
    gather_disk_state,
    plan_start,
)
from mileage.checkpoint.stages import RL, SFT
from mileage.distributed import env
from mileage.errors import UserError
from mileage.models.hf import (
    check_weight_files,
    load_tokenizer,
    read_config_json,
    require_chat_template,
)
from mileage.precision import BF16, resolve
from mileage.rollout.agent import UserFunctions, load_user_functions
from mileage.rollout.builtin_model import builtin_config, builtin_model_dir, builtin_tokenizer
from mileage.rollout.data import EvalSet, load_eval_sets, load_train_prompts, task_reward
from mileage.rollout.dynamic import (
    BufferFilter,
    GroupFilter,
    load_buffer_filter,
    load_group_filter,
)
from mileage.rollout.engine import GENERATION_BATCH
from mileage.rollout.evaluation import check_eval_lengths
from mileage.rollout.prompts import Prompt
from mileage.rollout.rewards import RewardFn, build_reward_fn
from mileage.rollout.rollout import PromptEncoder
from mileage.rollout.sizes import (
    check_lora_rank,
    check_rollout_sizes,
    check_round_memory,
    context_length,
)
from mileage.rollout.vfenv import check_one_turn
from mileage.run_config import RunConfig
from mileage.tracking import check_tracking
from mileage.training.distill import plan_teacher
from mileage.training.memory import MemoryPlan, Workload, model_size, plan_memory
from mileage.training.memory_use import available_memory

# the prompts (longest in UTF-8 bytes) whose token count bounds a sample's: encoding every
# prompt of a large dataset would make the plan slow, and a longer byte count almost always
# means more tokens
LONGEST_PROMPTS = 16


def hf_checkpoint_path(cfg: RunConfig) -> str:
    """--hf-checkpoint, or the built-in model's cache directory (which may not be built yet)."""
    return cfg.checkpoint.hf_checkpoint or str(builtin_model_dir(cfg.data.builtin_task))


def with_recorded_model(cfg: RunConfig, log) -> RunConfig:
    """Raw mode without --hf-checkpoint: the model the --ref-load checkpoint records it came from."""
    ck = cfg.checkpoint
    if ck.megatron_to_hf_mode != "raw" or ck.hf_checkpoint or not ck.ref_load:
        return cfg
    try:
        checkpoint = selected_checkpoint(ck.ref_load, ck.ref_ckpt_step, "--ref-ckpt-step")
    except UserError:
        return cfg  # plan_start names what is wrong with --ref-load
    if not (checkpoint / META).is_file():
        return cfg  # an incomplete checkpoint: plan_start refuses it
    source = recorded_source(checkpoint)
    if source and source.get("builtin_task"):
        log(f"raw mode: architecture and tokenizer of the built-in model (as {checkpoint} records)")
        return cfg
    path = recorded_model_dir(checkpoint, log)
    return replace(cfg, checkpoint=replace(ck, hf_checkpoint=path))


def model_config_of(cfg: RunConfig) -> dict:
    if cfg.checkpoint.hf_checkpoint:
        return read_config_json(cfg.checkpoint.hf_checkpoint)
    return builtin_config(cfg.data.builtin_task).to_dict()


@dataclass
class Preflight:
    """Everything that can fail on user input, loaded before anything is written."""

    plan: ResumePlan
    flags: StartFlags
    prompts: list[Prompt]
    eval_sets: list[EvalSet]
    reward_fn: RewardFn
    group_filter: GroupFilter | None = None  # --dynamic-sampling-filter-path
    buffer_filter: BufferFilter | None = None  # --buffer-filter-path
    # --custom-generate-function-path, --rollout-function-path, the tool loop's flags
    user_functions: UserFunctions = field(default_factory=UserFunctions)
    memory: MemoryPlan | None = None  # None for a complete run


def memory_plan(
    cfg: RunConfig,
    model_config: dict,
    encode: PromptEncoder,
    prompts: list[Prompt],
    plan: ResumePlan,
    asynchronous: bool,
    local_engine: bool,
    teacher_params: int = 0,
) -> MemoryPlan:
    """The micro-batch and the memory estimate of this run, per rank (`mileage.training.memory`):
    refused here, before any generation, where it cannot fit."""
    rc, world = cfg.rollout, env.world_size()
    size = model_size(model_config, cfg.lora.lora_rank, cfg.lora.target_modules)
    longest = sorted(prompts, key=lambda p: -len(p.text.encode()))[:LONGEST_PROMPTS]
    prompt_tokens = max((len(encode(p.text)) for p in longest), default=0)
    context = context_length(model_config)
    if context:
        prompt_tokens = min(prompt_tokens, context - rc.rollout_max_response_len)
    samples = rc.samples_per_rollout
    if cfg.dynamic.enabled:
        samples = cfg.dynamic.round_size(rc.rollout_batch_size) * rc.n_samples_per_prompt
    global_batch = cfg.algo.batch_sizes(rc.samples_per_rollout)[0]
    work = Workload(
        samples=max(global_batch // world, 1),
        prompt_tokens=max(prompt_tokens, 1),
        response_tokens=rc.rollout_max_response_len,
        engine_rows=min(samples, GENERATION_BATCH) if local_engine else 0,
        bf16=plan.precision == BF16,
        chunk_tokens=cfg.algo.chunk_tokens(size.vocab),
        world_size=world,
        reference=cfg.algo.needs_reference,
        teacher_params=teacher_params,
        critic=plan.critic,
        overlapped=asynchronous,
        cuda=env.device().type == "cuda",
        group=rc.n_samples_per_prompt,
        shared_prompts=world == 1
        and not cfg.parallel.gradient_checkpointing
        and not cfg.algo.use_dynamic_batch_size,
        activation_checkpointing=cfg.parallel.gradient_checkpointing,
        max_tokens=cfg.algo.max_tokens_per_gpu if cfg.algo.use_dynamic_batch_size else None,
        offload=cfg.parallel.fsdp_cpu_offload,
    )
    saved = None
    if plan.action == RESUME and plan.weights_format == "native":
        # a run from before the micro-batch was recorded trained whole global batches
        saved = recorded_micro_batch(plan.weights_from) or global_batch // world
    available = min(ranks.all_gather_object(available_memory(env.device())))
    return plan_memory(size, work, cfg.algo.micro_batch_size, saved, available)


def require_directories(**paths: str | None) -> None:
    """Each given path is absent or a directory (a file there is a mistyped flag, not a start)."""
    for flag, path in paths.items():
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"--{flag.replace('_', '-')} {path} is a file, not a directory")


def preflight(cfg: RunConfig, asynchronous: bool = False, supervised: bool = False) -> Preflight:
    """The plan and its inputs; cheap (reads JSON and directory listings, no tensors; the
    model is built on the meta device to count its parameters)."""
    ck = cfg.checkpoint
    require_directories(save=ck.save, load=ck.load, ref_load=ck.ref_load)
    prompts = load_train_prompts(cfg.data)
    eval_sets = load_eval_sets(cfg.data)
    timeout = cfg.hooks.hook_timeout
    reward_fn = build_reward_fn(cfg.reward, task_reward(cfg.data), timeout)
    filter_path = cfg.dynamic.dynamic_sampling_filter_path
    group_filter = load_group_filter(filter_path, timeout) if filter_path else None
    buffer_path = cfg.dynamic.buffer_filter_path
    buffer_filter = load_buffer_filter(buffer_path, timeout) if buffer_path else None
    user_functions = load_user_functions(cfg.multiturn, timeout)
    check_one_turn(reward_fn, user_functions.generate is not None)
    check_tracking(cfg.tracking)
    model_config = model_config_of(cfg)
    if cfg.checkpoint.hf_checkpoint:
        # a broken tokenizer or weight file stops the run here, before anything is written
        tokenizer = load_tokenizer(cfg.checkpoint.hf_checkpoint)
        check_weight_files(cfg.checkpoint.hf_checkpoint)
    else:
        tokenizer = builtin_tokenizer(cfg.data.builtin_task)
    if cfg.data.apply_chat_template:
        require_chat_template(tokenizer, hf_checkpoint_path(cfg))
    rc = cfg.rollout
    local = cfg.engine.rollout_engine == "local" and not rc.load_debug_rollout_data
    encode = PromptEncoder(tokenizer, cfg.data.apply_chat_template)
    if cfg.loop.eval_interval:
        check_eval_lengths(model_config, encode, eval_sets, cfg.eval, rc)
    check_rollout_sizes(
        model_config,
        encode,
        [p.text for p in prompts],
        [],  # evaluation prompts: check_eval_lengths, against their own response length
        rc.rollout_batch_size,
        rc.n_samples_per_prompt,
        rc.rollout_max_response_len,
        env.device() if local else None,
    )
    if cfg.dynamic.enabled:
        round_size = cfg.dynamic.round_size(rc.rollout_batch_size)
        check_round_memory(round_size, rc.n_samples_per_prompt, rc.rollout_max_response_len)
    if cfg.lora.enabled:
        check_lora_rank(model_config, cfg.lora.lora_rank)
    flags = cfg.checkpoint.start_flags(hf_checkpoint_path(cfg), cfg.num_rollout(len(prompts)))
    ppo = cfg.algo.advantage_estimator == "ppo"
    precision, precision_note = resolve(cfg.precision.requested(), env.device())
    if precision == BF16 and local:
        logits = "fp32" if cfg.precision.fp32_lm_head else "bf16 (--no-fp32-lm-head)"
        precision_note += f"; the engine samples from {logits} logits"
    flags = replace(
        flags,
        world_size=env.world_size(),
        critic=ppo,
        critic_load=cfg.critic.critic_load,
        precision=precision,
        precision_note=precision_note,
        settings=cfg.trajectory_settings(),
        stage=SFT if supervised else RL,
    )
    disk = gather_disk_state(flags, model_config)
    if not cfg.checkpoint.hf_checkpoint and not disk.hf_checkpoint.exists:
        # the built-in model is built on first use; plan as if it were there
        built = DirState(flags.hf_checkpoint, True, hf_config=model_config, hf_weights=True)
        disk = replace(disk, hf_checkpoint=built)
    plan, memory = plan_start(flags, disk), None
    plan = replace(plan, reward_line=getattr(reward_fn, "plan_line", ""))
    teacher_params = 0
    if cfg.opd.use_opd and plan.action != COMPLETE:
        teacher, line = plan_teacher(cfg.opd, tokenizer, hf_checkpoint_path(cfg), model_config)
        plan = replace(plan, teacher_line=line)
        if teacher is not None:  # in the trainer: verified, loaded and counted like the rest
            plan = replace(plan, teacher_from=teacher.path, teacher_format=teacher.fmt)
            hf = teacher.fmt == "hf"
            teacher_params = model_size(
                read_config_json(teacher.path) if hf else model_config
            ).params
    if plan.action != COMPLETE:
        memory = memory_plan(
            cfg, model_config, encode, prompts, plan, asynchronous, local, teacher_params
        )
        plan = replace(
            plan,
            micro_batch=memory.micro_batch,
            memory=memory.to_dict(),
            memory_line=memory.describe(),
        )
    return Preflight(
        plan,
        flags,
        prompts,
        eval_sets,
        reward_fn,
        group_filter,
        buffer_filter,
        user_functions,
        memory,
    )
