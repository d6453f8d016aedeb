"""Mutation check: plant deliberate bugs in the resume, restore, replay, commit, input and loss
paths, one at a time in a scratch copy of the committed tree, and run the tests against each.

    python scripts/mutate.py [--only NAME ...] [--out docs/mutation.md] [--jobs 1]

Each mutant replaces one exact snippet of one file (the script stops if the snippet is no
longer there exactly once, so a refactor cannot silently retire a mutant) and names the test
files to run against it. A mutant is caught when at least one of those tests fails; every
mutant must be caught. Prints one row per mutant with the tests that caught it, writes the
table as markdown with --out, and exits 1 if any mutant survived.

New features add their own mutants to MUTANTS (engines, ranks, critic...).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RESUME = "tests/test_resume.py"
RESTORE = "tests/test_restore_flags.py"
REPLAY = "tests/test_replay.py"
PLAN = "tests/test_plan.py"
ERRORS = "tests/test_cli_errors.py"
CRASH = "tests/test_crash_anywhere.py"
FAULTS = "tests/test_save_faults.py"
PREEMPT = "tests/test_preemption.py"
LOSS = "tests/test_loss_reference.py"
ENGINES = "tests/test_engines.py"
VLLM = "tests/test_engines_vllm.py"
SERVE = "tests/test_serve.py"
DIST = "tests/test_distributed.py"
DIST_CHAIN = f"{DIST}::test_n2_kills_resume_to_the_uninterrupted_tensors_and_metrics"
DIST_N1 = f"{DIST}::test_n2_checkpoint_resumes_at_n1_exactly_and_trains_like_n2_on_the_same_samples"
SYNC_FAULT_CHAIN = (
    "test_a_failed_save_anywhere_in_the_commit_stops_cleanly_and_the_rerun_is_exact[sync]"
)
DIST_PPO_N1 = (
    "tests/test_distributed_ppo.py::"
    "test_n2_ppo_checkpoint_resumes_at_n1_and_trains_like_n2_on_the_same_samples"
)
DIST_ASYNC = "tests/test_distributed_async_save.py"
DIST_MEMORY = "tests/test_distributed_memory.py"
DIST_MEMORY_N2 = (
    f"{DIST_MEMORY}::test_n2_keeps_no_full_policy_between_rollouts_and_samples_as_a_copy"
)
PPO_PLAN = "tests/test_ppo_plan.py"
PPO_CRASH = "tests/test_ppo_crash.py"
BUILTIN = "tests/test_builtin_model.py"
BENCH_PATHS = "tests/test_bench_paths.py"
SEEDS = "tests/test_sampling_seeds.py"
SIZES = "tests/test_sizes.py"
LAST_BYTE = "tests/test_ckpt_last_byte.py"
TRACKING = "tests/test_tracking.py"
RECORDS = "tests/test_metrics_records.py"
RECORDS_KILLS = (
    f"{RECORDS}::test_evaluation_before_training_is_recorded_once_across_kills_everywhere"
)
PRECISION = "tests/test_precision.py"
MULTITURN = "tests/test_multiturn.py"
AGENTS = "tests/test_agents.py"
CHUNKED = "tests/test_chunked_logprobs.py"
MEMORY = "tests/test_memory.py"
RECOMPUTE = "tests/test_activation_checkpointing.py"
README_TEST = "tests/test_readme.py"
EVAL = "tests/test_evaluation.py"
EVAL_RUN = f"{EVAL}::test_named_eval_sets_log_pass_at_k_and_mileage_eval_reproduces_them"
README_SAMPLE = (
    f"{README_TEST}::test_rollout_lines_have_the_fields_and_formats_of_the_readme_sample"
)
DEVICE = "tests/test_device.py"
RNG_CUDA = "tests/test_rng_cuda.py"
SGLANG_CLIENT = "tests/test_sglang_client.py"
VLLM_CLIENT = "tests/test_vllm_client.py"
BROADCAST_E2E = f"{ENGINES}::test_weights_by_broadcast_equal_weights_from_disk"
ASYNC_CRASH = "tests/test_async_crash.py"
ASYNC_RESUME = f"{ASYNC_CRASH}::test_one_step_off_stopped_and_rerun_equals_the_uninterrupted_run"
ASYNC_ORDER = f"{ASYNC_CRASH}::test_one_step_off_trains_every_prompt_once_in_data_order"
ASYNC_S0 = f"{ASYNC_CRASH}::test_staleness_zero_is_train_tensor_for_tensor"
KEEP_UNIT = "tests/test_async.py::test_keep_old_actor_recomputes_each_row_with_the_weights_that_generated_it"
KEEP_CRASH = f"{ASYNC_CRASH}::test_keep_old_actor_kills_resume_to_the_uninterrupted_run"
ASYNC_N2 = "tests/test_distributed_remote.py::test_n2_train_async_equals_one_process_and_resumes_bit_for_bit"
LORA = "tests/test_lora.py"
LORA_CHAIN = f"{LORA}::test_kills_at_commit_points_resume_to_the_uninterrupted_tensors"
LORA_N1 = f"{LORA}::test_a_relaunched_lora_run_resumes_at_the_next_rollout"
LORA_REF = f"{LORA}::test_the_reference_is_the_base_with_the_adapter_off"
LORA_BASE = f"{LORA}::test_resuming_on_another_base_exits_2_naming_both"
LORA_EVAL = f"{LORA}::test_mileage_eval_of_a_lora_run_reproduces_the_logged_evaluation"
VERIFY_PARTS = "tests/test_ckpt_verify_parts.py"
LORA_ADAPTER = f"{LORA}::test_lora_adapter_path_starts_from_an_exported_adapter_of_this_base_only"
LORA_SERVE = f"{LORA}::test_mileage_serve_generates_with_the_merged_adapter"
LORA_DROPOUT = f"{LORA}::test_dropout_masks_depend_on_seed_and_step_not_on_the_rng_stream"
LORA_SYNC = "tests/test_lora_sync.py"
LORA_SERVED = f"{LORA_SYNC}::test_served_adapter_generates_exactly_as_the_trainers_local_engine"
LORA_SYNC_RUN = f"{LORA_SYNC}::test_a_lora_run_syncs_the_adapter_alone_to_mileage_serve"
LORA_VLLM = "tests/test_engines_vllm.py::test_a_lora_run_syncs_the_adapter_alone_or_merged_weights"
LORA_PPO = "tests/test_lora_ppo.py"
LORA_VLLM_N2 = (
    "tests/test_engines_vllm.py::"
    "test_torchrun_n2_lora_syncs_the_gathered_adapter_alone_or_merged_weights[no-runtime-lora]"
)
LORA_REMOTE_N2 = (
    "tests/test_lora_remote_fsdp.py::"
    "test_n2_lora_sends_the_adapter_alone_and_the_server_holds_the_trainers_adapter"
)
DYNAMIC = "tests/test_dynamic_sampling.py"
CORRECTIONS = "tests/test_corrections.py"
DYNAMIC_ROUNDS = f"{DYNAMIC}::test_rounds_fill_the_batch_in_submission_order_and_buffer_the_rest"
DYNAMIC_ACCOUNT = (
    f"{DYNAMIC}::test_no_trained_group_has_equal_rewards_and_every_drawn_prompt_is_accounted"
)
TOOL_TASK = "tests/test_tool_task.py"
TOOL_TASK_LABELS = (
    f"{TOOL_TASK}::test_warmup_trains_the_call_and_answer_not_the_prompt_or_the_tool_result"
)
TOOL_TASK_RUN = f"{TOOL_TASK}::test_two_rollouts_end_to_end_with_masked_tool_tokens"
DYNAMIC_CRASH = (
    f"{DYNAMIC}::test_kills_between_rounds_and_in_the_save_resume_to_the_uninterrupted_run"
)
PARTIAL = "tests/test_partial_rollout.py"
PARTIAL_ROUNDS = (
    f"{PARTIAL}::test_unfinished_groups_are_aborted_at_the_batch_and_continue_with_newer_weights"
)
PARTIAL_MASK = f"{PARTIAL}::test_offpolicy_mask_keeps_only_the_current_versions_tokens"
PARTIAL_ACCOUNT = (
    f"{PARTIAL}::test_partial_rollout_trains_continued_answers_and_accounts_for_every_prompt"
)
PARTIAL_CRASH = (
    f"{PARTIAL}::test_kills_between_rounds_and_at_commits_resume_to_the_uninterrupted_partial_run"
)

VF = "tests/test_verifiers.py"
VF_RUBRIC = f"{VF}::test_prompts_labels_and_the_rubric"
VF_TRACE = f"{VF}::test_the_trace_the_rubric_sees"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]


COMPOSE = "tests/test_compose.py"
DISTILL = "tests/test_distill.py"
PACKING = "tests/test_packing.py"
JUDGE = "tests/test_judge.py"
JUDGE_CRASH = "tests/test_judge_crash.py"
SERVED_TEACHER = "tests/test_distill_served.py"
SFT = "tests/test_sft.py"
PARTIAL_TOOLS = "tests/test_partial_tools.py"
PARTIAL_TOOLS_ROUNDS = f"{PARTIAL_TOOLS}::test_rounds_judge_a_group_when_its_last_trajectory_ends"
PARTIAL_TOOLS_SERVE = (
    "tests/test_multiturn_crash.py::"
    "test_partial_rollout_through_mileage_serve_kills_while_tools_run_resume_exactly"
)

MUTANTS = [
    Mutant(
        "resume-start-skips-a-rollout",
        "a resume starts at N+2 instead of N+1",
        "mileage/checkpoint/plan.py",
        "action, natural_start = RESUME, source.iteration + 1",
        "action, natural_start = RESUME, source.iteration + 2",
        (RESUME, PLAN),
    ),
    Mutant(
        "resume-repeats-a-rollout",
        "a resume starts at N instead of N+1",
        "mileage/checkpoint/plan.py",
        "action, natural_start = RESUME, source.iteration + 1",
        "action, natural_start = RESUME, source.iteration",
        (RESUME, PLAN),
    ),
    Mutant(
        "optimizer-not-restored",
        "a resume never loads the optimizer state",
        "mileage/components.py",
        "    if plan.load_optimizer:\n",
        "    if False:\n",
        (RESUME, RESTORE),
    ),
    Mutant(
        "no-load-optim-ignored",
        "restore loads the optimizer state even with --no-load-optim",
        "mileage/components.py",
        "    if plan.load_optimizer:\n",
        "    if True:\n",
        (RESTORE,),
    ),
    Mutant(
        "rng-not-restored",
        "a resume never restores the global RNG",
        "mileage/components.py",
        "    if plan.load_rng:\n",
        "    if False:\n",
        (RESTORE,),
    ),
    Mutant(
        "no-load-rng-ignored",
        "restore loads the global RNG even with --no-load-rng",
        "mileage/components.py",
        "    if plan.load_rng:\n",
        "    if True:\n",
        (RESTORE,),
    ),
    Mutant(
        "data-position-not-restored",
        "a resume starts the prompt data from the beginning",
        "mileage/components.py",
        "        *([DATA] if plan.load_data_state else []),\n",
        "",
        (RESUME,),
    ),
    Mutant(
        "lr-step-not-restored",
        "a resume restarts the LR schedule (optimizer step counter) at 0",
        "mileage/components.py",
        '    parts.register("actor", actor)\n',
        '    parts.register("actor", actor, "never")\n',
        (RESUME,),
    ),
    Mutant(
        "finetune-resumes",
        "--finetune resumes optimizer, data and rollout id instead of taking only weights",
        "mileage/checkpoint/plan.py",
        "resumable = source.iteration is not None and not flags.finetune",
        "resumable = source.iteration is not None",
        (RESTORE, PLAN),
    ),
    Mutant(
        "replay-inverts-rewards",
        "replayed samples get inverted rewards and zero behaviour log-probs",
        "mileage/rollout/rollout.py",
        "samples = [Sample.from_record(r) for r in records]",
        'samples = [Sample.from_record({**r, "reward": 1.0 - r["reward"], '
        '"logprobs": [0.0] * len(r["logprobs"])}) for r in records]',
        (REPLAY,),
    ),
    Mutant(
        "metrics-not-cut-back",
        "a resume keeps the metrics of rollouts it will train again",
        "mileage/metrics.py",
        '            kept = [r for r in read_metrics(self.path.parent) if r["rollout_id"] < rollout_id]\n',
        "            kept = read_metrics(self.path.parent)\n",
        # a kill after logging and before the save leaves records the resume must drop
        (f"{CRASH}::test_sync_kills_resume_to_the_uninterrupted_tensors_and_metrics",),
    ),
    Mutant(
        "tracker-before-rename",
        "the tracker moves to a checkpoint before its directory is renamed into place",
        "mileage/checkpoint/store.py",
        "        os.rename(staging, target)\n",
        "        write_tracker(save_dir, name)\n        os.rename(staging, target)\n",
        (f"{FAULTS}::{SYNC_FAULT_CHAIN}",),
    ),
    Mutant(
        "leftovers-kept",
        "a start never removes what interrupted saves left behind",
        "mileage/checkpoint/store.py",
        "    if not save_dir.is_dir():\n        return []\n    removed = []",
        "    return []\n    removed = []",
        (f"{FAULTS}::test_the_rerun_removes_and_names_what_a_killed_save_left",),
    ),
    Mutant(
        "dcp-failure-message-keeps-the-traceback",
        "a DCP save failure that is no OSError (a full disk in torch.save) is reported with "
        "DCP's whole text, every rank's traceback included",
        "mileage/checkpoint/tensors.py",
        '        line = (str(first).strip().splitlines() or [""])[0]\n',
        "        line = str(exc)\n",
        (f"{FAULTS}::test_a_dcp_failure_that_is_no_os_error_is_one_line_with_the_room_left",),
    ),
    Mutant(
        "failed-save-keeps-staging",
        "a failed save leaves its staging directory behind",
        "mileage/checkpoint/store.py",
        "    except OSError as exc:\n        shutil.rmtree(staging, ignore_errors=True)\n",
        "    except OSError as exc:\n",
        (f"{FAULTS}::{SYNC_FAULT_CHAIN}",),
    ),
    Mutant(
        "async-save-overlaps",
        "a background save starts before the previous one finished, reusing its buffers",
        "mileage/checkpoint/writer.py",
        "            self.schedule.saved()  # unsaved work is counted from here\n        self.wait()\n",
        "            self.schedule.saved()  # unsaved work is counted from here\n",
        (
            "tests/test_checkpoint_tools.py::"
            "test_a_background_save_finishes_before_the_next_one_reuses_its_buffers",
        ),
    ),
    Mutant(
        "positivity-check-removed",
        "count and length flags are no longer checked for > 0",
        "mileage/cross_checks.py",
        "if value is not None and (value <= 0 if positive else value < 0):",
        "if value is not None and not positive and value < 0:",
        (ERRORS,),
    ),
    Mutant(
        "response-len-unchecked",
        "--rollout-max-response-len is dropped from the positive flags",
        "mileage/cross_checks.py",
        '    ("rollout", "n_samples_per_prompt"),\n    ("rollout", "rollout_max_response_len"),\n    ("loop", "num_threads"),\n',
        '    ("rollout", "n_samples_per_prompt"),\n    ("loop", "num_threads"),\n',
        (ERRORS,),
    ),
    Mutant(
        "second-signal-ignored",
        "a second SIGTERM no longer exits at once",
        "mileage/preemption.py",
        "            os._exit(128 + signum)\n",
        "            return\n",
        (PREEMPT,),
    ),
    Mutant(
        "entropy-bonus-sign",
        "the entropy bonus is subtracted from the objective (added to the loss)",
        "mileage/training/actor.py",
        "loss = loss - self.algo.entropy_coef * entropy_loss",
        "loss = loss + self.algo.entropy_coef * entropy_loss",
        (LOSS,),
    ),
    Mutant(
        "micro-batch-normalised-alone",
        "each micro-batch's loss is divided by its own size, not the global batch's",
        "mileage/training/losses.py",
        "        self.denominator = global_denominator\n",
        "        self.denominator = LossReducer.global_denominator(mask, per_token)\n",
        (LOSS,),
    ),
    Mutant(
        "critic-counters-not-restored",
        "a PPO resume restarts the critic's step and rollout counters (LR, critic-only warm-up)",
        "mileage/components.py",
        '        parts.register("critic", critic, CRITIC)',
        '        parts.register("critic", critic, "never")',
        (PPO_CRASH,),
    ),
    Mutant(
        "critic-optimizer-not-restored",
        "a PPO resume starts the critic's optimizer state afresh",
        "mileage/components.py",
        "    if plan.critic_state and plan.load_optimizer:\n",
        "    if False:\n",
        (PPO_CRASH,),
    ),
    Mutant(
        "critic-weights-not-restored",
        "a PPO resume builds the critic from the actor's weights instead of its checkpoint",
        "mileage/training/critic.py",
        "    if critic_from is not None and not meta:\n        load_tensors(",
        "    if False:\n        load_tensors(",
        (PPO_CRASH,),
    ),
    Mutant(
        "critic-not-committed-with-actor",
        "the actor's checkpoint commits without the critic",
        "mileage/checkpoint/store.py",
        "    if state.critic is not None:\n        _write_critic(directory / CRITIC_DIR, state.critic, tensors_written)\n",
        "",
        (PPO_PLAN,),
    ),
    Mutant(
        "critic-behind-actor-accepted",
        "a resume pairs the actor with a critic saved at another rollout",
        "mileage/checkpoint/critic_plan.py",
        '    if rollout is not None and meta.get("rollout_id") != rollout:',
        "    if False:",
        (PPO_PLAN,),
    ),
    Mutant(
        "critic-of-another-model-accepted",
        "a critic saved for another model config is loaded",
        "mileage/checkpoint/critic_plan.py",
        '        diffs = config_differences(meta["model_config"], model_config)',
        "        diffs = []",
        (PPO_PLAN,),
    ),
    Mutant(
        "stale-samples-accepted",
        "samples of an older weight version than the engine's are trained on",
        "mileage/rollout/rollout.py",
        "    if refused is not None:\n",
        "    if False:\n",
        (f"{ENGINES}::test_samples_of_an_older_weight_version_are_refused",),
    ),
    Mutant(
        "restarted-server-keeps-start-weights",
        "a restarted vLLM server is not given the current weights",
        "mileage/rollout/engines/vllm.py",
        "        self._load(self.weights_path, self.weight_version)\n",
        "",
        (
            f"{VLLM}::test_a_launched_server_that_dies_mid_rollout_is_restarted_and_the_run_is_exact",
        ),
    ),
    Mutant(
        "launched-server-never-restarted",
        "a launched vLLM server that fails mid-rollout is not restarted",
        "mileage/rollout/engines/vllm.py",
        "                if self.server is None or self.restarts_left <= 0:\n",
        "                if True:\n",
        (
            f"{VLLM}::test_a_launched_server_that_dies_mid_rollout_is_restarted_and_the_run_is_exact",
        ),
    ),
    Mutant(
        "cut-off-reply-escapes",
        "a reply cut off mid-body escapes as http.client.IncompleteRead (a traceback)",
        "mileage/rollout/engines/http.py",
        "    except http.client.HTTPException as exc:\n        # a server that dies mid-reply",
        "    except ZeroDivisionError as exc:\n        # a server that dies mid-reply",
        (f"{ENGINES}::test_a_reply_cut_off_mid_body_is_a_bad_reply_not_a_traceback",),
    ),
    Mutant(
        "broadcast-flag-ignored",
        "--rollout-weight-sync broadcast still syncs through the disk",
        "mileage/rollout/engines/factory.py",
        'cfg.rollout_weight_sync_address if cfg.rollout_weight_sync == "broadcast" else None',
        "None",
        (f"{ENGINES}::test_weights_by_broadcast_equal_weights_from_disk",),
    ),
    Mutant(
        "broadcast-weights-not-loaded",
        "mileage serve receives broadcast weights but does not load them",
        "mileage/serve/broadcast.py",
        "                    params[name].copy_(value)  # casts to the model's dtype, as SGLang loads\n",
        "                    pass\n",
        (f"{ENGINES}::test_weights_by_broadcast_equal_weights_from_disk",),
    ),
    Mutant(
        "torchrun-workers-outlive-launcher",
        "torchrun workers do not die with a SIGKILLed torchrun",
        "mileage/parent_death.py",
        "    parent = os.getppid()\n    armed = False\n",
        "    return False\n",
        (f"{DIST}::test_a_sigkilled_torchrun_takes_its_workers_with_it_and_the_rerun_resumes",),
    ),
    Mutant(
        "engine-not-synced-after-training",
        "the servers never get the weights of a training step (they keep the start's)",
        "mileage/sources/on_policy.py",
        "    def after_train(self, rollout_id: int, drawn: Drawn) -> tuple[bool, dict]:\n        sync_engine(self.run)\n",
        "    def after_train(self, rollout_id: int, drawn: Drawn) -> tuple[bool, dict]:\n",
        (
            f"{ENGINES}::test_two_rollouts_on_two_servers_learn_and_the_servers_follow_the_weights",
            f"{VLLM}::test_launched_server_trains_with_weight_sync_and_is_stopped",
        ),
    ),
    Mutant(
        "row-seed-constant",
        "a remote engine sends every row of a rollout the same sampling seed",
        "mileage/rollout/engines/base.py",
        'derive_seed(self.seed, f"{self.purpose}/{self.rollout_id}/sample", row) & ROW_SEED_MASK',
        'derive_seed(self.seed, f"{self.purpose}/{self.rollout_id}/sample", 0) & ROW_SEED_MASK',
        (
            f"{ENGINES}::test_two_rollouts_on_two_servers_learn_and_the_servers_follow_the_weights",
            f"{ENGINES}::test_one_server_draws_the_samples_of_two",
        ),
    ),
    Mutant(
        "server-ignores-row-seed",
        "mileage serve draws each row from its own random seed, not the request's sampling_seed",
        "mileage/serve/server.py",
        "generators = [torch.Generator().manual_seed(seed) for seed in seeds]",
        "generators = [torch.Generator().manual_seed(torch.seed()) for seed in seeds]",
        (
            f"{ENGINES}::test_one_server_draws_the_samples_of_two",
            f"{ENGINES}::test_resume_through_mileage_serve_is_bit_exact",
        ),
    ),
    Mutant(
        "rollout-retries-disabled",
        "a failed generate request is never retried on another server",
        "mileage/rollout/engines/http.py",
        "        for _ in range(self.attempts):\n",
        "        for _ in range(1):\n",
        (
            f"{ENGINES}::test_a_faulty_server_is_retried_on_the_other",
            f"{ENGINES}::test_when_every_try_fails_the_run_stops_and_a_rerun_continues",
        ),
    ),
    Mutant(
        "missed-sync-server-still-used",
        "a server that missed a weight sync still generates (from the old weights)",
        "mileage/rollout/engines/http.py",
        "            self.excluded = set(failed)\n",
        "            self.excluded = set()\n",
        (
            f"{ENGINES}::test_a_weight_sync_excludes_the_servers_that_missed_it_and_stops_when_all_did",
        ),
    ),
    Mutant(
        "rollout-logprobs-flag-ignored",
        "--use-rollout-logprobs still trains against the trainer's recomputed log-probs",
        "mileage/training/mismatch.py",
        "    if not cfg.use_rollout_logprobs:\n        batch.old_logprobs = trainer\n",
        "    if True:\n        batch.old_logprobs = trainer\n",
        (f"{ENGINES}::test_tis_and_rollout_logprobs",),
    ),
    Mutant(
        "wandb-offline-points-relogged",
        "an offline resume ignores the steps W&B's earlier files hold and logs them again",
        "mileage/tracking.py",
        "    return max(steps) + 1 if steps else 0\n",
        "    return 0\n",
        (f"{TRACKING}::test_points_logged_past_the_checkpoint_are_kept_not_repeated",),
    ),
    # ---- torchrun + FSDP2 (mileage/distributed/); each names the cheapest test that catches it
    Mutant(
        "dist-groups-sampled-twice",
        "at N=2 every rank samples the first share of the groups: the gathered rollout repeats "
        "them and misses the rest",
        "mileage/distributed/rollout.py",
        "        for group in env.share(groups):\n",
        "        for group in env.share(groups, index=0):\n",
        (f"{DIST}::test_n2_samples_answer_the_prompts_of_their_group_and_cover_every_group",),
    ),
    Mutant(
        "dist-generation-weights-stale",
        "the plain full-weight copy kept for generation (bf16 mixed precision) is never "
        "refreshed after an update",
        "mileage/distributed/rollout.py",
        "            copy_full_weights(model, self.engine.model)\n",
        "            pass\n",
        (f"{DIST_MEMORY}::test_a_plain_generation_copy_is_refreshed_and_the_policy_is_not_copied",),
    ),
    Mutant(
        "dist-generation-copy-kept",
        "at N=2 every rank keeps a full copy of the policy for the in-process engine again",
        "mileage/distributed/setup.py",
        '    keep_copy = local and parallel.fsdp_mixed_precision != "none"\n',
        "    keep_copy = local\n",
        (DIST_MEMORY_N2,),
    ),
    Mutant(
        "dist-mmap-threshold-not-kept",
        "torchrun ranks leave glibc's mmap threshold to rise: freed tensors stay resident",
        "mileage/distributed/env.py",
        "    keep_mmap_threshold()\n",
        "",
        (DIST_MEMORY_N2,),
    ),
    Mutant(
        "mmap-threshold-never-set",
        "keep_mmap_threshold reports success without calling mallopt",
        "mileage/distributed/memory.py",
        "    return mallopt(M_MMAP_THRESHOLD, threshold) == 1\n",
        "    return True\n",
        (
            f"{DIST_MEMORY}::test_freed_large_tensors_leave_the_resident_set_only_with_the_threshold_kept",
        ),
    ),
    Mutant(
        "dist-generation-not-resharded",
        "the parameters gathered for generation are never freed: every rank keeps them whole",
        "mileage/distributed/parallelize.py",
        "            module.reshard()  # frees the gathered values; local, no collective\n",
        "",
        (DIST_MEMORY_N2,),
    ),
    Mutant(
        "dist-optimizer-loaded-unsharded",
        "a resume at N=2 loads each optimizer tensor whole instead of as its parameter's shard",
        "mileage/checkpoint/tensors.py",
        "                targets[name] = torch.empty_like(param, dtype=dtype, requires_grad=False)\n",
        "                targets[name] = torch.empty(meta.size, dtype=dtype)\n",
        (DIST_CHAIN,),
    ),
    Mutant(
        "dist-data-position-rank-0-only",
        "a resume at N=2 restores the data position on rank 0 only",
        "mileage/components.py",
        "        *([DATA] if plan.load_data_state else []),\n",
        "        *([DATA] if plan.load_data_state and env.is_main() else []),\n",
        (DIST_CHAIN,),
    ),
    Mutant(
        "dist-gradients-averaged",
        "FSDP averages gradients over ranks instead of summing them (half the N=1 gradient)",
        "mileage/distributed/parallelize.py",
        "        module.set_gradient_divide_factor(1.0)\n",
        "",
        (DIST_N1,),
    ),
    Mutant(
        "dist-micro-batches-overlap",
        "every rank trains on the first rank's share of the global batch",
        "mileage/ranks.py",
        "    mine = share(global_batch)\n",
        "    mine = share(global_batch, index=0)\n",
        (DIST_N1,),
    ),
    Mutant(
        "dist-stats-from-rank-0",
        "logged training statistics are rank 0's alone, not summed over ranks",
        "mileage/ranks.py",
        "    if not is_distributed():\n        return values\n    total",
        "    if True:\n        return values\n    total",
        (DIST_N1,),
    ),
    Mutant(
        "dist-rng-of-rank-0-everywhere",
        "every rank restores rank 0's global RNG state",
        "mileage/distributed/checkpoint.py",
        '    prefix = f"{RANK_PREFIX}{env.rank()}."\n',
        '    prefix = f"{RANK_PREFIX}0."\n',
        (f"{DIST}::test_rng_of_each_rank_round_trips_and_fewer_ranks_fall_back_to_rank_0",),
    ),
    Mutant(
        "dist-lock-refusal-not-shared",
        "when rank 0 cannot take the save directory's lock the other ranks are not told",
        "mileage/distributed/coordination.py",
        "    on_rank0(lambda: lock.acquire() and None)  # the lock object stays on rank 0\n",
        "    if env.is_main():\n        lock.acquire()\n",
        (f"{DIST}::test_second_torchrun_job_on_a_save_in_use_exits_2_on_every_rank",),
    ),
    Mutant(
        "dist-critic-trains-whole-batch-on-every-rank",
        "under torchrun every rank trains the critic on the whole global batch (its summed "
        "gradient is N times one process's)",
        "mileage/training/critic.py",
        "            for part in batching.rank_parts(batch, g_start, gbs):\n",
        "            for part in (batch.slice(m, m + batching.micro) "
        "for m in range(g_start, g_start + gbs, batching.micro)):\n",
        (DIST_PPO_N1,),
    ),
    Mutant(
        "dist-critic-stats-from-this-rank",
        "the critic's value loss and clip fraction are this rank's share, not summed over ranks",
        "mileage/training/critic.py",
        '        totals = ranks.sum_over_ranks({"value_loss": loss_total, "value_clipfrac": clip_total})\n',
        '        totals = {"value_loss": loss_total, "value_clipfrac": clip_total}\n',
        (DIST_PPO_N1,),
    ),
    Mutant(
        "broadcast-group-name-fixed",
        "every trainer forms its weight-update group under one fixed name (a rerun after a "
        "kill cannot form a group with servers that hold the dead trainer's)",
        "mileage/rollout/engines/broadcast.py",
        "        self.group_name = new_group_name()\n",
        "",
        (
            "tests/test_distributed_remote.py::"
            "test_n2_broadcast_killed_between_buckets_on_either_rank_resumes_to_the_uninterrupted_run",
        ),
    ),
    Mutant(
        "dist-vllm-tied-head-not-written",
        "under torchrun the weights written for vLLM keep a tied LM head (vLLM's reload skips it)",
        "mileage/distributed/remote.py",
        '            if self.untie_head and getattr(config, "tie_word_embeddings", False):\n',
        "            if False:\n",
        (
            "tests/test_engines_vllm.py::"
            "test_torchrun_n2_trains_through_a_vllm_server_that_rank_0_launches_and_resumes_exactly",
        ),
    ),
    Mutant(
        "dist-meta-buffers-not-broadcast",
        "ranks built on the meta device keep uninitialised buffers (the rotary frequencies are "
        "not in the state dict rank 0 broadcasts)",
        "mileage/distributed/parallelize.py",
        "            dist.broadcast(buffer, src=0)\n",
        "            pass\n",
        ("tests/test_distributed_load.py",),
    ),
    Mutant(
        "dist-meta-generation-copy-head-untied",
        "the generation copy of a rank built on the meta device keeps an LM head of its own, "
        "never filled (it is filled under the embedding's name only)",
        "mileage/distributed/parallelize.py",
        '            if hasattr(generation_copy, "tie_weights"):\n'
        "                generation_copy.tie_weights()\n",
        "",
        ("tests/test_distributed_load.py",),
    ),
    Mutant(
        "rank0-refusal-not-shared",
        "a refusal while rank 0 alone reads weights stops rank 0 only (the others hang)",
        "mileage/distributed/coordination.py",
        "shared = env.broadcast_object(error if env.is_main() else None)",
        "shared = None",
        ("tests/test_distributed_load.py",),
    ),
    Mutant(
        "dist-async-save-rng-of-rank-0-only",
        "a background save at N=2 keeps rank 0's RNG states only (the others are not gathered)",
        "mileage/distributed/checkpoint.py",
        "        snapshot = self._staged(replace(state, rng=gather_rng(state.rng)))\n",
        "        snapshot = self._staged(state)\n",
        (f"{DIST_ASYNC}::test_n2_async_save_writes_what_a_sync_save_writes",),
    ),
    Mutant(
        "builtin-shipped-sha-unchecked",
        "the shipped built-in weights are unpacked without checking their pinned sha256",
        "mileage/rollout/builtin_model.py",
        "    if actual != expected:\n",
        "    if False:\n",
        (BUILTIN,),
    ),
    Mutant(
        "builtin-cache-trusted",
        "a cached built-in model is used without checking it is the shipped one",
        "mileage/rollout/builtin_model.py",
        "        if file_sha256(weights) == expected:\n",
        "        if True:\n",
        (BUILTIN,),
    ),
    Mutant(
        "builtin-warmup-exports-the-first-check",
        "the built-in warm-up exports its first checked checkpoint, not the one it stopped at, so "
        "a warm-up checked more often ships an earlier model",
        "mileage/rollout/builtin_warmup.py",
        '        _mileage("export-hf", "--load", str(work / "sft"), "--out", str(out))\n',
        '        _mileage("export-hf", "--load", str(work / "sft"), "--out", str(out), '
        '"--ckpt-step", str(recipe["check_every"] - 1))\n',
        (f"{BUILTIN}::test_a_build_is_the_same_however_often_checked_and_ships_as_built",),
    ),
    Mutant(
        "builtin-warmup-passes-fault-points-on",
        "a run that builds a built-in model on first use passes its fault-injection variables to "
        "the warm-up's `mileage sft`, which then dies at the point aimed at the run",
        "mileage/rollout/builtin_warmup.py",
        'if k == "MILEAGE_HOME" or not k.startswith("MILEAGE_")',
        "if True",
        (f"{BUILTIN}::test_a_build_is_the_same_however_often_checked_and_ships_as_built",),
    ),
    Mutant(
        "bench-out-suffix-always-added",
        "the benchmarks' --out gets .json appended even when it has it (x.json.json)",
        "bench/_common.py",
        '    if path.suffix.lower() != ".json":\n',
        "    if True:\n",
        (BENCH_PATHS,),
    ),
    Mutant(
        "seed-rollout-id-dropped-in-process",
        "the in-process engine samples every rollout from the same generator",
        "mileage/rollout/engines/base.py",
        "generator_for(self.seed, self.purpose, self.rollout_id)",
        "generator_for(self.seed, self.purpose, 0)",
        (SEEDS,),
    ),
    Mutant(
        "seed-rollout-id-dropped-in-row-seeds",
        "remote engines send the same row seeds in every rollout",
        "mileage/rollout/engines/base.py",
        'f"{self.purpose}/{self.rollout_id}/sample"',
        'f"{self.purpose}/sample"',
        (SEEDS,),
    ),
    Mutant(
        "seed-row-dropped-in-row-seeds",
        "remote engines send every row of a rollout the same seed",
        "mileage/rollout/engines/base.py",
        '/sample", row)',
        '/sample", 0)',
        (SEEDS,),
    ),
    Mutant(
        "seed-sglang-index-in-group",
        "SGLang rows are seeded by their index in the group (miles' and slime's scheme)",
        "mileage/rollout/engines/sglang.py",
        'one["sampling_seed"] = seed.row_seed(row)',
        'one["sampling_seed"] = seed.row_seed(row - rows.start)',
        (SEEDS,),
    ),
    Mutant(
        "seed-vllm-index-in-group",
        "vLLM requests are seeded by their index in the group",
        "mileage/rollout/engines/vllm.py",
        'payload["seed"] = seed.row_seed(row)',
        'payload["seed"] = seed.row_seed(row % group_size)',
        (SEEDS,),
    ),
    Mutant(
        "seed-rank-local-group-index",
        "under torchrun each rank seeds its groups by their local index (ranks repeat a stream)",
        "mileage/distributed/rollout.py",
        "torch.Generator().manual_seed(seeds[group])",
        "torch.Generator().manual_seed(seeds[group - env.share(groups).start])",
        (SEEDS,),
    ),
    Mutant(
        "seed-same-every-rollout",
        "a rollout's samples are seeded as rollout 0 (the same noise every rollout and epoch)",
        "mileage/rollout/rollout.py",
        "else SamplingSeed(seed, rollout_id)",
        "else SamplingSeed(seed, 0)",
        (f"{SEEDS}::test_a_run_samples_the_same_prompts_differently_in_each_epoch",),
    ),
    Mutant(
        "checksum-first-chunk-only",
        "a file's checksum covers only its first 4 MiB read",
        "mileage/checkpoint/files.py",
        "        while chunk := handle.read(1 << 22):\n            digest.update(chunk)\n",
        "        digest.update(handle.read(1 << 22))\n",
        (LAST_BYTE,),
    ),
    Mutant(
        "sizes-batch-over-data-allowed",
        "a rollout batch larger than the prompt set is not refused",
        "mileage/rollout/sizes.py",
        "    if batch > len(train_texts):\n",
        "    if batch > 10 * len(train_texts) + 1000:\n",
        (f"{SIZES}::test_batch_larger_than_the_data_is_refused",),
    ),
    Mutant(
        "sizes-prompt-length-ignored",
        "only the response length is checked against the context, not prompt plus response",
        "mileage/rollout/sizes.py",
        "    if prompt_len + max_new_tokens > context:\n",
        "    if max_new_tokens > context:\n",
        (SIZES,),
    ),
    Mutant(
        "sizes-template-overhead-ignored",
        "prompts are pre-selected by byte count without the tokens the tokenizer adds",
        "mileage/rollout/sizes.py",
        "if n + overhead > limit",
        "if n > limit",
        (f"{SIZES}::test_prompt_over_encodes_only_prompts_that_may_be_too_long",),
    ),
    Mutant(
        "sizes-kv-cache-unchecked",
        "a generation batch's KV cache is not checked against the device's memory",
        "mileage/rollout/sizes.py",
        "dtype_bytes), memory_bytes(device)\n    if need <= have:\n        return None\n",
        "dtype_bytes), memory_bytes(device)\n    return None\n",
        (
            f"{SIZES}::test_kv_cache_that_cannot_fit_is_refused",
            f"{SIZES}::test_serve_refuses_a_kv_cache_that_cannot_fit",
        ),
    ),
    Mutant(
        "serve-sizes-unchecked",
        "mileage serve generates whatever max_new_tokens a request asks for",
        "mileage/serve/server.py",
        "        self._check_sizes(rows, params.max_new_tokens)\n",
        "",
        (
            f"{SIZES}::test_serve_answers_400_with_a_json_error_and_keeps_serving",
            f"{SIZES}::test_serve_refuses_max_new_tokens_past_the_context",
            f"{SIZES}::test_serve_refuses_a_kv_cache_that_cannot_fit",
        ),
    ),
    Mutant(
        "drift-reported-as-kl",
        "without a reference model the drift from the sampling policy is reported as `kl`",
        "mileage/training/actor.py",
        '        stats["ppo_kl"] = float(reduce(part.old_logprobs - logp.detach()))\n',
        '        stats["ppo_kl"] = stats["kl"] = float(reduce(part.old_logprobs - logp.detach()))\n',
        (
            f"{RECORDS}::test_without_a_reference_the_drift_is_ppo_kl_and_there_is_no_kl",
            README_SAMPLE,
        ),
    ),
    Mutant(
        "eval-before-training-not-recorded",
        "the evaluation before training is printed but not written to metrics.jsonl/trackers",
        "mileage/loop.py",
        '        run.metrics.log({"rollout_id": EVAL_BEFORE_TRAINING, **metrics})\n',
        "",
        (RECORDS_KILLS,),
    ),
    Mutant(
        "eval-record-kept-on-restart",
        "a start at rollout 0 keeps the evaluation record of a killed process and adds its own",
        "mileage/metrics.py",
        "        if rollout_id <= 0:\n            rollout_id = EVAL_BEFORE_TRAINING\n",
        "",
        (
            f"{RECORDS}::test_cut_back_keeps_the_evaluation_before_training_unless_the_run_starts_over",
            RECORDS_KILLS,
        ),
    ),
    Mutant(
        "eval-record-dropped-on-resume",
        "the resume cut-back drops the record of the evaluation before training",
        "mileage/metrics.py",
        '            kept = [r for r in read_metrics(self.path.parent) if r["rollout_id"] < rollout_id]\n',
        '            kept = [r for r in read_metrics(self.path.parent) if 0 <= r["rollout_id"] < rollout_id]\n',
        (
            f"{RECORDS}::test_cut_back_keeps_the_evaluation_before_training_unless_the_run_starts_over",
            RECORDS_KILLS,
        ),
    ),
    Mutant(
        "wandb-step-is-rollout-id",
        "W&B logs record N at step N, so the evaluation before training (-1) is never logged",
        "mileage/tracking.py",
        '    return record["rollout_id"] + 1\n',
        '    return record["rollout_id"]\n',
        (f"{RECORDS}::test_wandb_steps_start_at_0_with_the_evaluation_and_never_repeat",),
    ),
    Mutant(
        "tensorboard-no-purge",
        "TensorBoard shows the points a killed process logged past its checkpoint twice",
        "mileage/tracking.py",
        "        self.writer = SummaryWriter(str(self.log_dir), purge_step=start)\n",
        "        self.writer = SummaryWriter(str(self.log_dir))\n",
        (RECORDS_KILLS,),
    ),
    Mutant(
        "plot-drops-eval-before-training",
        "`mileage plot` starts the held-out curve at the first evaluation after training",
        "mileage/plot.py",
        "r in records if r.get(key) is not None)",
        'r in records if r.get(key) is not None and r["rollout_id"] >= 0)',
        (f"{RECORDS}::test_plot_starts_the_held_out_curve_at_the_evaluation_before_training",),
    ),
    Mutant(
        "checkpoint-file-renamed",
        "a checkpoint file is named otherwise than the README's layout shows",
        "mileage/checkpoint/store.py",
        'TRAINER_STATE = "trainer_state.json"\n',
        'TRAINER_STATE = "trainer.json"\n',
        (f"{README_TEST}::test_the_checkpoint_layout_is_the_one_the_readme_shows",),
    ),
    Mutant(
        "progress-field-renamed",
        "the rollout line names a field otherwise than the README's sample line",
        "mileage/progress.py",
        "        parts.append(f\"entropy {record['entropy']:.3f}\")\n",
        "        parts.append(f\"ent {record['entropy']:.3f}\")\n",
        (README_SAMPLE,),
    ),
    Mutant(
        "readme-flag-renamed",
        "a flag of the README's table is renamed in the program (--seed)",
        "mileage/run_config.py",
        '    seed: int = option(1234, "seed for sampling, shuffling and initialisation")\n',
        '    seed: int = option(1234, "seed for sampling, shuffling and initialisation", '
        'flag="--random-seed")\n',
        (f"{README_TEST}::test_flags_at_a_glance_are_in_train_help_with_their_choices",),
    ),
    Mutant(
        "gpu-only-under-torchrun",
        "CUDA is used only at a world size above 1 (a single GPU trains on the CPU)",
        "mileage/distributed/env.py",
        'if choice != "cpu" and torch.cuda.is_available():',
        'if choice != "cpu" and torch.cuda.is_available() and world_size() > 1:',
        (DEVICE,),
    ),
    Mutant(
        "cuda-rng-of-device-0",
        "the CUDA RNG of device 0 is saved and restored, not the current device's",
        "mileage/seeding.py",
        "        device = torch.cuda.current_device()\n",
        "        device = 0\n",
        (RNG_CUDA,),
    ),
    Mutant(
        "cuda-rng-text-order",
        "an older checkpoint's CUDA states are taken in text order (torch_cuda_10 before _2)",
        "mileage/seeding.py",
        "    return legacy.get(device)",
        "    return dict(enumerate(legacy[k] for k in sorted(map(str, legacy)))).get(device)",
        (RNG_CUDA,),
    ),
    Mutant(
        "row-seed-63-bits",
        "remote row seeds keep 63 bits (an int32 seed tensor in SGLang overflows)",
        "mileage/rollout/engines/base.py",
        '/sample", row) & ROW_SEED_MASK',
        '/sample", row)',
        (SGLANG_CLIENT,),
    ),
    Mutant(
        "seed-check-skipped",
        "a server started without --enable-deterministic-inference is used silently",
        "mileage/rollout/engines/server_info.py",
        "    ignoring = [i.url for i in infos if not i.deterministic]",
        "    ignoring = []",
        (SGLANG_CLIENT,),
    ),
    Mutant(
        "group-counts-tp-only",
        "the weight-update group counts tp_size ranks per server (dp/pp > 1 hangs)",
        "mileage/rollout/engines/server_info.py",
        '    workers = _positive(info, "tp_size") * _positive(info, "pp_size") * _positive(info, "dp_size")',
        '    workers = _positive(info, "tp_size")',
        (SGLANG_CLIENT,),
    ),
    Mutant(
        "bucket-over-limit",
        "a bucket takes one tensor past --update-weight-buffer-size",
        "mileage/rollout/engines/broadcast.py",
        "        if current and used + size > limit:",
        "        if current and used > limit:",
        (SGLANG_CLIENT,),
    ),
    Mutant(
        "weights-sent-in-fp32",
        "broadcast sync sends the trainer's dtype, not the servers'",
        "mileage/rollout/engines/broadcast.py",
        "bucket = {n: t.detach().to(self.dtype).contiguous() for n, t in tensors.items()}",
        "bucket = {n: t.detach().contiguous() for n, t in tensors.items()}",
        (SGLANG_CLIENT,),
    ),
    Mutant(
        "every-bucket-labels-version",
        "every bucket carries the weight version (a half-updated server claims the new one)",
        "mileage/rollout/engines/broadcast.py",
        '    if last:\n        request["weight_version"] = str(version)',
        '    request["weight_version"] = str(version)',
        (
            SGLANG_CLIENT,
            f"{SERVE}::test_broadcast_in_buckets_loads_every_tensor_and_a_short_update_is_refused",
        ),
    ),
    Mutant(
        "serve-refuses-partial-buckets",
        "mileage serve refuses a bucket that is not the whole model",
        "mileage/serve/broadcast.py",
        "            if done:\n                arrived = self.pending | set(received)",
        "            if True:\n                arrived = self.pending | set(received)",
        (
            f"{SERVE}::test_broadcast_in_buckets_loads_every_tensor_and_a_short_update_is_refused",
            BROADCAST_E2E,
        ),
    ),
    Mutant(
        "one-request-in-flight",
        "--sglang-server-concurrency is ignored: one request in flight per server",
        "mileage/rollout/engines/sglang.py",
        "        self.pool.in_flight = concurrency",
        "        self.pool.in_flight = 1",
        (SGLANG_CLIENT,),
    ),
    Mutant(
        "empty-reply-is-bad",
        "an empty 2xx body (vLLM < 0.32's /reset_prefix_cache) is a bad reply",
        "mileage/rollout/engines/http.py",
        "    if not body.strip():\n",
        "    if not body.strip() and False:\n",
        (VLLM_CLIENT,),
    ),
    Mutant(
        "old-vllm-retried",
        "a vLLM without the 0.32 endpoints is treated as a failed sync, not named",
        "mileage/rollout/engines/vllm.py",
        "            on_failure=lambda url, endpoint, why: check_server_api(\n"
        "                url, endpoint, why, self.sync_timeout\n"
        "            ),\n",
        "",
        (VLLM_CLIENT,),
    ),
    Mutant(
        "cpu-flags-on-gpu",
        "the CPU launch flags are given on a GPU too",
        "mileage/rollout/engines/vllm_server.py",
        "*(CPU_LAUNCH_DEFAULTS if on_cpu else ())",
        "*CPU_LAUNCH_DEFAULTS",
        (VLLM_CLIENT,),
    ),
    Mutant(
        "bf16-old-logprobs-from-fp32-copy",
        "under --fsdp-mixed-precision bf16 the fp32 generation copy's log-probs are the old policy",
        "mileage/distributed/rollout.py",
        "        self.in_process = loss_precision_matches\n",
        "        self.in_process = True\n",
        ("tests/test_mixed_precision_logprobs.py",),
    ),
    Mutant(
        "n2-servers-miss-the-weights",
        "under torchrun the servers are never given the trained weights",
        "mileage/distributed/remote.py",
        "            self.engine.load_weights_from(path, version)\n",
        "            self.engine.weight_version = version\n",
        (
            "tests/test_distributed_remote.py::test_n2_through_servers_learns_and_the_servers_follow_the_weights",
        ),
    ),
    Mutant(
        "n2-broadcast-sends-shards",
        "under torchrun, broadcast sync sends each rank-0 shard instead of the gathered tensor",
        "mileage/distributed/remote.py",
        "            bucket = {n: full_value(tensors[n].detach()) for n in names}  # all ranks",
        "            bucket = {n: tensors[n].detach() for n in names}  # all ranks",
        (
            "tests/test_distributed_remote.py::test_n2_broadcast_from_the_shards_in_buckets_equals_the_disk_synced_run",
        ),
    ),
    Mutant(
        "journal-of-resumed-rollout-pruned",
        "a resume drops the tool journal of the rollouts it generates again (a tool with outside "
        "state then answers them differently)",
        "mileage/loop.py",
        "        keep_from = run.plan.start_rollout_id if resumed else 1 << 62\n",
        "        keep_from = 1 << 62\n",
        (f"{COMPOSE}::test_a_random_tool_s_answers_are_replayed_from_the_journal_after_a_kill",),
    ),
    Mutant(
        "async-filter-skipped",
        "train-async keeps every group, ignoring --dynamic-sampling-filter-path",
        "mileage/sources/producer.py",
        "            if kept:\n                self.buffer.groups.append(group)\n",
        "            if True:\n                self.buffer.groups.append(group)\n",
        (f"{COMPOSE}::test_async_dynamic_sampling_shaping_tools_and_lora_resume_exactly",),
    ),
    Mutant(
        "async-shaping-skipped",
        "the overlong penalty is applied by the on-policy source only, not to samples generated ahead",
        "mileage/loop.py",
        "    shaped = shape_rewards(drawn.samples, cfg.shaping, cfg.rollout.rollout_max_response_len)\n",
        "    shaped = drawn.samples\n",
        (
            f"{COMPOSE}::test_async_dynamic_sampling_shaping_tools_and_lora_resume_exactly",
            "tests/test_shaping.py",
        ),
    ),
    Mutant(
        "async-buffer-not-saved",
        "train-async commits checkpoints without the rollout buffer (the pre-generated slot is lost)",
        "mileage/sources/ahead.py",
        "            run.parts.register(STATE_KEY, run.buffer, DATA)\n",
        "            pass\n",
        (ASYNC_RESUME,),
    ),
    Mutant(
        "async-buffer-not-restored",
        "a resumed train-async run starts with an empty rollout buffer",
        "mileage/sources/ahead.py",
        "            run.parts.register(STATE_KEY, run.buffer, DATA)\n",
        '            run.parts.register(STATE_KEY, run.buffer, "never")\n',
        (ASYNC_RESUME,),
    ),
    Mutant(
        "async-completion-order",
        "slots are collected newest first instead of in submission order",
        "mileage/sources/producer.py",
        "        slot, policy, future = self.pending.popleft()\n",
        "        slot, policy, future = self.pending.pop()\n",
        (ASYNC_ORDER,),
    ),
    Mutant(
        "async-engine-at-wrong-version",
        "generation runs one slot further ahead, so slots use weights one version too old",
        "mileage/async_config.py",
        "        return engine_rollouts + self.update_weights_interval - 1 + self.lead(",
        "        return engine_rollouts + self.update_weights_interval + self.lead(",
        (ASYNC_ORDER,),
    ),
    Mutant(
        "async-clip-against-behaviour",
        "the decoupled loss keeps the engine's (behaviour) log-probs as the PPO old policy",
        "mileage/sources/ahead.py",
        "    batch.old_logprobs, batch.tis_weights = proximal, weights\n",
        "    batch.tis_weights = weights\n",
        ("tests/test_async.py",),
    ),
    Mutant(
        "async-engine-copy-without-grad",
        "the async in-process engine's copy has requires_grad off (other CPU kernels, other bits)",
        "mileage/rollout/engines/detached.py",
        "        own = copy.deepcopy(model).eval()\n",
        "        own = copy.deepcopy(model).requires_grad_(False).eval()\n",
        (ASYNC_S0,),
    ),
    Mutant(
        "keep-old-actor-not-saved",
        "--keep-old-actor checkpoints leave out the kept weights the buffered groups came from",
        "mileage/sources/ahead.py",
        "            state.old_actor = self.old_actor.state_tensors(g.policy_rollouts for g in buffer.groups)\n",
        "            pass\n",
        (KEEP_CRASH,),
    ),
    Mutant(
        "keep-old-actor-rows-under-current-weights",
        "--keep-old-actor recomputes every row with the trainer's current weights",
        "mileage/training/old_actor.py",
        "            if version == current:\n",
        "            if True:\n",
        (KEEP_UNIT,),
    ),
    Mutant(
        "keep-old-actor-kept-one-version-late",
        "the weights synced after rollout N are kept under version N (overwriting the generating ones)",
        "mileage/sources/ahead.py",
        "            hand_weights(run, self.old_actor, rollout_id + 1)\n",
        "            hand_weights(run, self.old_actor, rollout_id)\n",
        (KEEP_CRASH,),
    ),
    Mutant(
        "keep-old-actor-pruned-too-early",
        "kept versions are pruned down to the engine's, dropping those buffered groups still need",
        "mileage/sources/ahead.py",
        "            self.old_actor.prune(versions_needed(producer, self.engine_policy))\n",
        "            self.old_actor.prune({self.engine_policy})\n",
        (KEEP_CRASH,),
    ),
    Mutant(
        "async-torchrun-samples-not-shared",
        "under torchrun the other ranks wait on a generation they never started (no broadcast)",
        "mileage/distributed/background.py",
        "        self.shared = remote and env.is_distributed()",
        "        self.shared = False",
        (ASYNC_N2,),
    ),
    Mutant(
        "lora-optimizer-state-not-saved",
        "a LoRA checkpoint saves no optimizer state for the adapter",
        "mileage/components.py",
        "        optimizer=optimizer_tensors(run.model, run.actor.optimizer),\n",
        "        optimizer=optimizer_tensors(run.model, run.actor.optimizer)\n"
        "        if run.lora is None\n"
        "        else {},\n",
        (LORA_CHAIN, LORA_N1),
    ),
    Mutant(
        "lora-reference-with-adapter",
        "the KL reference is computed with the adapter enabled (the policy itself)",
        "mileage/models/lora.py",
        "            with self.peft_model.disable_adapter():\n",
        "            with torch.no_grad():\n",
        (LORA_REF,),
    ),
    Mutant(
        "lora-dropout-in-generation",
        "the adapter's dropout modules stay in training mode until the first optimizer step",
        "mileage/models/lora.py",
        "    wrapped.eval()\n",
        "    pass\n",
        (LORA_CHAIN, LORA_N1),
    ),
    Mutant(
        "lora-restored-unverified",
        "a LoRA run restores its adapter, optimizer, critic, buffer and RNG without verifying "
        "the checkpoint's checksums",
        "mileage/components.py",
        "    stop_together(lambda: verify_sources(sources) if env.is_main() else None)\n",
        "    if not cfg.lora.enabled:\n"
        "        stop_together(lambda: verify_sources(sources) if env.is_main() else None)\n",
        (VERIFY_PARTS,),
    ),
    Mutant(
        "resume-verifies-the-weights-alone",
        "a resume verifies the model weights' files, not the rest of the checkpoint it restores",
        "mileage/checkpoint/store.py",
        '        if digest != entry["sha256"]\n',
        '        if digest != entry["sha256"] and name.startswith(MODEL_DIR)\n',
        (VERIFY_PARTS,),
    ),
    Mutant(
        "mileage-eval-of-lora-merges-the-adapter",
        "`mileage eval` of a LoRA run evaluates merged weights, not the adapter as training did",
        "mileage/cli/eval_command.py",
        "        model = restore_recorded_policy(str(checkpoint), load, log).model\n",
        "        model = restore_recorded_policy(str(checkpoint), load, log).peft_model"
        ".merge_and_unload()\n",
        (LORA_EVAL,),
    ),
    Mutant(
        "mileage-eval-in-fp32",
        "`mileage eval` computes in fp32 whatever precision the checkpoint trained in (caught "
        "where the LoRA reference trains in bf16: a CPU or GPU with native bf16)",
        "mileage/cli/eval_command.py",
        "    set_precision(model, _precision(cfg, meta), cfg.precision.fp32_lm_head)\n",
        "",
        (LORA_EVAL,),
    ),
    Mutant(
        "lora-base-digest-ignored",
        "a LoRA checkpoint resumes on whatever base the run is given",
        "mileage/training/lora.py",
        '    if theirs_base.get("weights_sha256") != our_base["weights_sha256"]:\n',
        "    if False:\n",
        (LORA_BASE,),
    ),
    Mutant(
        "lora-adapter-base-unchecked",
        "--lora-adapter-path loads an adapter of another base when the shapes fit",
        "mileage/models/lora.py",
        '    if recorded and recorded.get("weights_sha256") != base["weights_sha256"]:\n',
        "    if False:\n",
        (LORA_ADAPTER,),
    ),
    Mutant(
        "lora-dropout-not-indexed",
        "the adapter's dropout masks come from the global RNG stream, not from (seed, step)",
        "mileage/training/actor.py",
        "        if self.dropout_seed is None:\n",
        "        if True:\n",
        (LORA_DROPOUT,),
    ),
    Mutant(
        "lora-merged-sync-stale",
        "a remote engine keeps the merged weights of the start (the view is never refreshed)",
        "mileage/training/lora_sync.py",
        "        self.engine.update_weights(self.view.refresh(), version)\n",
        "        self.engine.update_weights(self.view.model, version)\n",
        (LORA_SERVE,),
    ),
    Mutant(
        "lora-n2-adapter-stale",
        "under torchrun the servers are sent the adapter gathered at the first sync, every sync",
        "mileage/distributed/lora_remote.py",
        "        full = gather_full(trainable)  # all ranks\n",
        "        full = gather_full(trainable)  # all ranks\n"
        "        self.first = full = getattr(self, 'first', None) or full\n",
        (LORA_REMOTE_N2,),
    ),
    Mutant(
        "lora-n2-merge-unscaled",
        "under torchrun the merged weights rank 0 computes leave out the adapter's alpha / rank",
        "mileage/distributed/lora_remote.py",
        "        delta = (delta * layer.scaling[ADAPTER]).to(weight.dtype)\n",
        "        delta = delta.to(weight.dtype)\n",
        (
            LORA_VLLM_N2,
            "tests/test_colocate.py::"
            "test_under_torchrun_a_lora_run_s_engines_take_the_merged_weights",
        ),
    ),
    Mutant(
        "lora-adapter-synced-once",
        "a server that takes adapters gets the first version of the adapter only",
        "mileage/training/lora_sync.py",
        "        update = self._write(version)\n",
        "        if self.said:\n            return\n        update = self._write(version)\n",
        (LORA_SYNC_RUN,),
    ),
    Mutant(
        "served-adapter-ignored",
        "mileage serve generates with the base alone whatever adapter a request names",
        "mileage/serve/server.py",
        "            with self.lora.adapters.active(adapter):\n",
        "            with self.lora.adapters.active(None):\n",
        (LORA_SERVED,),
    ),
    Mutant(
        "served-adapter-partial-load",
        "mileage serve loads an adapter missing tensors (PEFT's random init stands in)",
        "mileage/serve/lora.py",
        "        if missing or unexpected:\n",
        "        if unexpected:\n",
        (LORA_SERVED,),
    ),
    Mutant(
        "sglang-request-names-no-adapter",
        "SGLang requests name no adapter after an adapter-only sync (the base generates)",
        "mileage/rollout/engines/sglang.py",
        "        if self.adapter is not None:\n",
        "        if False:\n",
        (LORA_SYNC_RUN,),
    ),
    Mutant(
        "vllm-request-names-no-adapter",
        "vLLM requests name the base model after an adapter-only sync",
        "mileage/rollout/engines/vllm.py",
        '"model": self.adapter.name if self.adapter is not None else SERVED_NAME,',
        '"model": SERVED_NAME,',
        (LORA_VLLM,),
    ),
    Mutant(
        "lora-ppo-critic-copies-the-peft-model",
        "a LoRA PPO run's critic is a copy of the adapted actor (PEFT layers, base frozen)",
        "mileage/components.py",
        "        start = MergedView(lora.peft_model, config_dir).model if lora else None\n",
        "        start = None\n",
        (LORA_PPO,),
    ),
    Mutant(
        "mis-rejected-tokens-in-denominator",
        "masked IS zeroes the rejected tokens' weights but leaves them in the loss mask",
        "mileage/training/mismatch.py",
        "        batch.tis_weights, batch.loss_mask = weights * kept, kept\n",
        "        batch.tis_weights = weights * kept\n",
        (CORRECTIONS,),
    ),
    Mutant(
        "sequence-is-per-token",
        "--tis-level sequence computes a ratio per token",
        "mileage/training/corrections.py",
        '    if level == "sequence":\n',
        "    if False:\n",
        (CORRECTIONS,),
    ),
    Mutant(
        "opsm-ignores-advantage-sign",
        "OPSM masks every sequence past the threshold, positive advantages too",
        "mileage/training/corrections.py",
        "    drop = (advantage < 0) & (seq_kl > delta)\n",
        "    drop = seq_kl > delta\n",
        (CORRECTIONS,),
    ),
    Mutant(
        "dynamic-filtered-group-trained",
        "a group the dynamic-sampling filter drops is counted as dropped but still trained",
        "mileage/rollout/dynamic.py",
        "                dropped[reason] += 1\n            elif len(groups) < batch_size:",
        "                dropped[reason] += 1\n            if len(groups) < batch_size:",
        (DYNAMIC_ROUNDS, DYNAMIC_ACCOUNT),
    ),
    Mutant(
        "data-position-skips-buffered",
        "the saved data position does not count the prompts of buffered groups (finished or in "
        "flight): a resume draws them again and an epoch no longer has each prompt once",
        "mileage/components.py",
        '    trainer = {**run.parts.state_dict(), "rng": rng_plain}\n',
        '    trainer = {**run.parts.state_dict(), "rng": rng_plain}\n'
        "    if run.buffer is not None:\n"
        '        trainer["data"]["offset"] = max(0, trainer["data"]["offset"] - '
        "len(run.buffer.groups) - len(run.buffer.partial))\n",
        (PARTIAL_ACCOUNT,),
    ),
    Mutant(
        "partial-versions-not-carried",
        "a continued answer's tokens are all relabelled with the newest weight version",
        "mileage/rollout/partial.py",
        "            sample.weight_versions = (sample.weight_versions or []) + [c.weight_version] * len(\n"
        "                c.response_ids\n"
        "            )\n",
        "            sample.weight_versions = [c.weight_version] * len(sample.response_ids)\n",
        (PARTIAL_ROUNDS, PARTIAL_ACCOUNT),
    ),
    Mutant(
        "partial-offpolicy-not-masked",
        "--mask-offpolicy-in-partial-rollout counts the older versions' tokens but trains on them",
        "mileage/training/batch.py",
        "                batch.loss_mask[row, first + i] = 0.0\n",
        "                pass\n",
        (PARTIAL_MASK,),
    ),
    Mutant(
        "partial-restarts-from-prompt",
        "a continued sample is generated from its prompt alone, not prompt + partial answer",
        "mileage/rollout/partial.py",
        "            inputs = [rows[i].prompt_ids + rows[i].response_ids for i in picked]\n",
        "            inputs = [rows[i].prompt_ids for i in picked]\n",
        (PARTIAL_ROUNDS,),
    ),
    Mutant(
        "partial-aborted-not-saved",
        "checkpoints leave out the groups in flight (aborted answers are lost on resume)",
        "mileage/rollout/buffer.py",
        '            state["partial"] = [_group_state(g) for g in self.partial]\n',
        "            pass\n",
        (PARTIAL_ROUNDS, PARTIAL_CRASH),
    ),
    Mutant(
        "dynamic-leftover-not-saved",
        "checkpoints of dynamic sampling leave out the buffer of leftover kept groups",
        "mileage/components.py",
        "        parts.register(STATE_KEY, buffer, DATA)\n",
        "        pass\n",
        (DYNAMIC_CRASH, PARTIAL_CRASH),
    ),
    Mutant(
        "dynamic-leftover-not-restored",
        "a resumed dynamic-sampling run starts with an empty buffer (its leftover groups are lost)",
        "mileage/components.py",
        "        parts.register(STATE_KEY, buffer, DATA)\n",
        '        parts.register(STATE_KEY, buffer, "never")\n',
        (DYNAMIC_CRASH, PARTIAL_CRASH),
    ),
    Mutant(
        "dynamic-rounds-share-a-seed",
        "every sampling round samples with the same seed slot (the slot counter never moves)",
        "mileage/rollout/dynamic.py",
        "        buffer.next_slot += 1\n",
        "",
        (DYNAMIC_ROUNDS,),
    ),
    Mutant(
        "dynamic-buffer-newest-first",
        "a rollout takes the newest buffered group first instead of submission order",
        "mileage/rollout/dynamic.py",
        "        return [buffer.groups.popleft() for _ in range(min(count, len(buffer.groups)))]\n",
        "        return [buffer.groups.pop() for _ in range(min(count, len(buffer.groups)))]\n",
        (DYNAMIC_ROUNDS,),
    ),
    Mutant(
        "pass-at-k-biased",
        "pass@k is the fraction of correct answers (the biased estimator), not 1 - C(n-c,k)/C(n,k)",
        "mileage/rollout/evaluation.py",
        "    return 1.0 - math.comb(n - c, k) / math.comb(n, k)\n",
        "    return c / n\n",
        (f"{EVAL}::test_pass_at_k_is_the_closed_form_of_chen_et_al",),
    ),
    Mutant(
        "pass-rates-first-group-only",
        "pass@k of a dataset is the first prompt's, not the mean over its prompts",
        "mileage/rollout/evaluation.py",
        "        for i in range(0, len(rewards), group_size)\n",
        "        for i in range(0, group_size, group_size)\n",
        (f"{EVAL}::test_pass_rates_average_groups_at_powers_of_two_and_n",),
    ),
    Mutant(
        "eval-seeds-are-training-seeds",
        "sampled evaluation at rollout N draws training's numbers of rollout N",
        "mileage/rollout/evaluation.py",
        '    return SamplingSeed(seed, rollout_id, f"eval/{name}")\n',
        "    return SamplingSeed(seed, rollout_id)\n",
        (f"{EVAL}::test_eval_seeds_are_deterministic_and_never_training_s",),
    ),
    Mutant(
        "eval-seeds-shared-by-datasets",
        "every evaluation dataset draws the same numbers",
        "mileage/rollout/evaluation.py",
        '    return SamplingSeed(seed, rollout_id, f"eval/{name}")\n',
        '    return SamplingSeed(seed, rollout_id, "eval")\n',
        (f"{EVAL}::test_eval_seeds_are_deterministic_and_never_training_s",),
    ),
    Mutant(
        "eval-always-greedy",
        "--n-samples-per-eval-prompt 4 without --eval-temperature samples 4 greedy copies",
        "mileage/rollout/evaluation.py",
        "            temperature = (\n                0.0 if self.n_samples_per_eval_prompt == 1 else rollout.rollout_temperature\n            )\n",
        "            temperature = 0.0\n",
        (EVAL_RUN,),
    ),
    Mutant(
        "eval-name-without-path-accepted",
        "--eval-prompt-data a PATH b: the odd name is not refused in one line",
        "mileage/rollout/data.py",
        "    if len(values) % 2:\n",
        "    if False:\n",
        (
            f"{EVAL}::test_bad_eval_input_is_one_line_exit_2",
            f"{EVAL}::test_eval_prompt_data_pairs_and_a_single_path",
        ),
    ),
    Mutant(
        "mileage-eval-seeds-of-rollout-0",
        "`mileage eval` samples iter_N with rollout 0's seeds, not those training's evaluation used",
        "mileage/cli/eval_command.py",
        "            -1 if rollout_id is None else int(rollout_id),\n",
        "            0,\n",
        (EVAL_RUN,),
    ),
    Mutant(
        "precision-not-recorded",
        "meta.json does not record the precision a checkpoint was trained in",
        "mileage/components.py",
        "            **extra,\n            precision=run.plan.precision,\n",
        "            **extra,\n",
        (
            f"{PRECISION}::test_a_checkpoint_records_its_precision_and_another_precision_is_announced",
        ),
    ),
    Mutant(
        "precision-change-not-announced",
        "a resume in another precision proceeds without saying so",
        "mileage/checkpoint/plan.py",
        "        reasons += _precision_change(source.info, flags.precision)\n",
        "",
        (f"{PLAN}::test_plan_names_a_precision_change_and_only_then",),
    ),
    Mutant(
        "auto-ignores-the-hardware",
        "--precision auto picks bf16 on a CPU that only emulates it",
        "mileage/precision.py",
        "    chosen = BF16 if native else FP32\n",
        "    chosen = BF16\n",
        (f"{PRECISION}::test_auto_picks_bf16_only_where_the_cpu_computes_it_natively",),
    ),
    Mutant(
        "generation-in-fp32",
        "the in-process engine generates in fp32 while the trainer computes in bf16",
        "mileage/rollout/engine.py",
        "        with torch.no_grad(), generation_autocast(self.model):\n",
        '        with torch.no_grad(), torch.autocast("cpu", enabled=False):\n',
        (f"{PRECISION}::test_the_local_engine_generates_in_the_models_precision",),
    ),
    Mutant(
        "training-in-fp32",
        "the trainer's forward ignores the precision (fp32 while generation is bf16)",
        "mileage/training/actor.py",
        "    with autocast(model):\n",
        '    with torch.autocast("cpu", enabled=False):\n',
        (f"{PRECISION}::test_the_local_engine_generates_in_the_models_precision",),
    ),
    Mutant(
        "bf16-old-logprobs-from-the-engine",
        "in bf16 the PPO ratio's old log-probs are the engine's, not the loss's precision",
        "mileage/training/mismatch.py",
        "        or precision == BF16\n",
        "",
        (f"{PRECISION}::test_ppo_ratio_is_exactly_one_at_the_first_step",),
    ),
    Mutant(
        "logprob-blocks-skip-a-row",
        "the blocked log-prob function leaves the last row of every block uncomputed",
        "mileage/training/logprobs.py",
        "    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]\n",
        "    return [slice(start, min(start + step - 1, rows)) for start in range(0, rows, step)]\n",
        ("tests/test_logprobs.py",),
    ),
    Mutant(
        "logprob-gradient-misses-the-target",
        "the hand-written log-prob backward leaves out the target's +1 (only -p remains)",
        "mileage/training/logprobs.py",
        "            g.scatter_add_(-1, flat_targets[block], grad_logp[block])\n",
        "",
        ("tests/test_logprobs.py::test_blocks_give_the_unblocked_values_and_gradients",),
    ),
    Mutant(
        "entropy-bonus-gradient-sign",
        "the entropy bonus's hand-written gradient has the wrong sign",
        "mileage/training/logprobs.py",
        "            g.mul_(-grad_entropy[block])\n",
        "            g.mul_(grad_entropy[block])\n",
        ("tests/test_logprobs.py::test_gradients_pass_gradcheck_in_float64",),
    ),
    Mutant(
        "logprobs-overwrite-fp32-logits",
        "at temperature 1 the blocked log-probs normalise fp32 logits in place, corrupting them",
        "mileage/training/logprobs.py",
        "    x = logits.to(_compute_dtype(logits), copy=True)\n",
        "    x = logits.to(_compute_dtype(logits))\n",
        ("tests/test_logprobs.py::test_blocks_give_the_unblocked_values_and_gradients",),
    ),
    Mutant(
        "cpu-attention-not-upcast",
        "mileage_sdpa runs bf16 attention on a CPU instead of fp32",
        "mileage/models/attention.py",
        "    if not upcast_on_cpu(query, key, value):\n",
        "    if True:\n",
        ("tests/test_attention.py",),
    ),
    Mutant(
        "bf16-keeps-stock-attention",
        "set_precision(bf16) leaves a transformers model on stock (bf16) SDPA attention",
        "mileage/precision.py",
        "    use_mileage_attention(model, precision == BF16)\n",
        "",
        ("tests/test_attention.py",),
    ),
    Mutant(
        "fast-decoder-ignores-mileage-attention",
        "the engine's fast decoder attends in bf16 while the model's own forward attends in fp32",
        "mileage/rollout/fast_decode.py",
        "        self.mileage_attention = model.config._attn_implementation == attention.NAME\n",
        "        self.mileage_attention = False\n",
        (
            "tests/test_engine.py::test_the_fast_decoder_is_bit_identical_to_stepping_the_transformers_model",
        ),
    ),
    Mutant(
        "generation-in-inference-mode",
        "the engine generates under inference_mode, where autocast re-rounds every weight at "
        "every decode step",
        "mileage/rollout/engine.py",
        "        with torch.no_grad(), generation_autocast(self.model):\n",
        "        with torch.inference_mode(), generation_autocast(self.model):\n",
        (
            "tests/test_engine.py::"
            "test_bf16_generation_rounds_each_weight_once_per_batch_not_per_token",
        ),
    ),
    Mutant(
        "old-from-pass-over-several-steps",
        "the training forward stands in for the old log-probs even when the rollout takes "
        "several optimizer steps (the later steps' ratio is then always 1)",
        "mileage/training/mismatch.py",
        "        algo.batch_sizes(samples)[0] == samples\n",
        "        algo.batch_sizes(samples)[0] > 0\n",
        (
            "tests/test_precision.py::"
            "test_old_log_probs_from_the_pass_only_where_nothing_needs_them_before_it",
            "tests/test_precision.py::test_ppo_ratio_is_exactly_one_at_the_first_step",
        ),
    ),
    Mutant(
        "old-from-pass-despite-reward-kl",
        "the old log-probs come from the training forward although the reward's KL penalty "
        "needed them before it",
        "mileage/training/mismatch.py",
        "        and not (actor.reference is not None and algo.kl_coef)\n",
        "",
        (
            "tests/test_precision.py::"
            "test_old_log_probs_from_the_pass_only_where_nothing_needs_them_before_it",
        ),
    ),
    Mutant(
        "old-from-pass-keeps-engine-logprobs",
        "with old log-probs from the pass, the engine's stay the PPO ratio's denominator",
        "mileage/training/actor.py",
        "    part.old_logprobs = logp.detach() * part.loss_mask\n",
        "    part.old_logprobs = engine\n",
        (
            "tests/test_precision.py::test_ppo_ratio_is_exactly_one_at_the_first_step",
            "tests/test_mixed_precision_logprobs.py",
        ),
    ),
    Mutant(
        "generation-logits-in-bf16",
        "the engine samples a bf16 model's tokens from logits rounded to bf16 although the run "
        "asked for fp32 logits",
        "mileage/precision.py",
        "        stack.enter_context(fp32_logits())\n",
        "        pass\n",
        (
            "tests/test_lm_head.py::"
            "test_bf16_generation_samples_from_fp32_logits_and_training_keeps_bf16",
        ),
    ),
    Mutant(
        "run-ignores-fp32-lm-head",
        "a run builds its policy without the fp32 LM head it planned",
        "mileage/build.py",
        "    set_precision(model, plan.precision, cfg.precision.fp32_lm_head)\n",
        "    set_precision(model, plan.precision)\n",
        ("tests/test_lm_head.py::test_a_bf16_run_builds_its_policy_with_the_switch_and_says_so",),
    ),
    Mutant(
        "fp32-logits-in-training-too",
        "the switched head computes in fp32 in every forward, training's included",
        "mileage/models/lm_head.py",
        '        if getattr(_state, "on_hidden", None) is not None or not getattr(_state, "active", False):\n',
        '        if getattr(_state, "on_hidden", None) is not None:\n',
        (
            "tests/test_lm_head.py::"
            "test_bf16_generation_samples_from_fp32_logits_and_training_keeps_bf16",
        ),
    ),
    Mutant(
        "vllm-dtype-not-the-trainers",
        "a launched vLLM gets --dtype float32 whatever the trainer's precision",
        "mileage/rollout/engines/factory.py",
        "    dtype = torch_dtype_name(precision_of(model))\n",
        '    dtype = "float32"\n',
        (f"{VLLM}::test_a_launched_server_gets_the_trainers_precision_as_dtype",),
    ),
    Mutant(
        "serve-reload-drops-the-dtype",
        "`mileage serve` computes reloaded weights in fp32 whatever its --dtype",
        "mileage/serve/server.py",
        "self.engine.update_weights(set_precision(model, self.precision, self.fp32_lm_head))",
        "self.engine.update_weights(model)",
        (f"{SERVE}::test_serve_says_its_dtype_and_keeps_it_across_weight_reloads",),
    ),
    Mutant(
        "vf-reward-ignores-weights",
        "a verifiers task's reward sums its rubric's scores without their weights",
        "mileage/rollout/vfenv.py",
        "return float(trace.reward)",
        "return float(sum(r.score for r in trace.rewards.values() if r is not None))",
        (VF_RUBRIC,),
    ),
    Mutant(
        "vf-system-prompt-dropped",
        "a verifiers task's system prompt is left out of the prompt",
        "mileage/rollout/vfenv.py",
        "messages.insert(0, vf.SystemMessage(content=data.system_prompt))",
        "pass",
        (VF_TRACE,),
    ),
    Mutant(
        "vf-skip-ignored",
        "verifiers:ID?skip=M starts at the first task (a held-out set repeats training tasks)",
        "mileage/rollout/vfenv.py",
        "view = taskset.skip(spec.skip) if spec.skip else taskset",
        "view = taskset",
        (VF_RUBRIC,),
    ),
    Mutant(
        "vf-eval-tasks-not-scored",
        "the scorer knows only the training taskset's tasks, not the evaluation sets'",
        "mileage/rollout/data.py",
        'scorer.add(vfenv.load_tasks(spec, "--eval-prompt-data"))',
        "pass",
        (VF_RUBRIC,),
    ),
    Mutant(
        "vf-tool-servers-accepted",
        "a verifiers task with MCP tool servers is played as if it had none",
        "mileage/rollout/vfenv.py",
        "    if task_cls.toolsets(task.config):",
        "    if False:",
        (f"{VF}::test_what_does_not_fit_is_refused_in_one_line",),
    ),
    Mutant(
        "vf-multi-turn-scored-as-one-reply",
        "a verifiers rubric is accepted as the reward of a multi-turn tool loop",
        "mileage/rollout/vfenv.py",
        "if generates_turns and isinstance(reward_fn, VerifiersScorer):",
        "if False:",
        (f"{VF}::test_training_on_a_taskset_resumes_exactly",),
    ),
    Mutant(
        "tool-task-warmup-trains-the-tool-output",
        "the addition-tool warm-up trains the model to write the calculator's result",
        "mileage/rollout/builtin_warmup.py",
        '{"role": "assistant" if trained else "tool", "content": text}',
        '{"role": "assistant", "content": text}',
        (TOOL_TASK_LABELS,),
    ),
    Mutant(
        "tool-task-eval-without-tools",
        "evaluation answers in one turn although the run generates with the tool loop",
        "mileage/rollout/evaluation.py",
        "    if agent is not None and agent.multi_turn:\n        return multi_turn_answers(",
        "    if False:\n        return multi_turn_answers(",
        (TOOL_TASK_RUN,),
    ),
    Mutant(
        "tool-task-defaults-not-applied",
        "--builtin-task addition-tool runs single-turn (its tool flags are not turned on)",
        "mileage/run_config.py",
        "            setattr(ns, name, task.get(name, value.value))",
        "            setattr(ns, name, value.value)",
        (TOOL_TASK_RUN,),
    ),
    Mutant(
        "tool-tokens-in-loss-mask",
        "the built-in tool loop gives the tool's tokens loss mask 1 (trained on)",
        "mileage/rollout/multiturn.py",
        "mask += [0] * len(tool_ids)",
        "mask += [1] * len(tool_ids)",
        (f"{MULTITURN}::test_trained_ids_are_the_engines_and_the_tools",),
    ),
    Mutant(
        "pack-ignores-loss-mask",
        "pack_samples marks every response token trained, tool tokens included",
        "mileage/training/batch.py",
        "torch.tensor(s.mask(), dtype=torch.float32)",
        "1.0",
        (f"{MULTITURN}::test_tool_tokens_carry_no_gradient",),
    ),
    Mutant(
        "retokenize-between-turns",
        "the tool loop re-encodes the decoded context before the next turn",
        "mileage/rollout/multiturn.py",
        "        context += tool_ids\n",
        "        context = ctx.tokenizer(decode(context + tool_ids, skip_special_tokens=True))[\n"
        '            "input_ids"\n'
        "        ]\n",
        (f"{MULTITURN}::test_trained_ids_are_the_engines_and_the_tools",),
    ),
    Mutant(
        "tool-journal-not-read-back",
        "a rerun calls the tool again instead of taking the journaled outcome",
        "mileage/rollout/journal.py",
        'if entry is None or entry["name"] != name',
        'if True or entry is None or entry["name"] != name',
        (f"{MULTITURN}::test_tool_journal_gives_a_rerun_the_first_outcomes",),
    ),
    Mutant(
        "multi-turn-seed-per-sample-not-per-call",
        "every client call of a sample samples with the seed of its first call",
        "mileage/rollout/client.py",
        "seed = None if params.greedy else self.seed_of(call)",
        "seed = None if params.greedy else self.seed_of(0)",
        (f"{MULTITURN}::test_turn_synchronous_batches_and_seeds",),
    ),
    Mutant(
        "multi-turn-batches-by-arrival",
        "engine calls go out as they arrive, not once every live trajectory waits",
        "mileage/rollout/client.py",
        "if not self.pending or len(waiting) < self.live:",
        "if not self.pending:",
        (f"{MULTITURN}::test_turn_synchronous_batches_and_seeds",),
    ),
    Mutant(
        "fast-decoder-norm-without-eps",
        "the fast decode path normalises without RMSNorm's epsilon (not bit-identical any more)",
        "mileage/rollout/fast_decode.py",
        "x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)",
        "x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))",
        (
            "tests/test_engine.py::"
            "test_the_fast_decoder_is_bit_identical_to_stepping_the_transformers_model",
        ),
    ),
    Mutant(
        "pool-leaves-a-server-out-silently",
        "a server that missed a weight sync is left out of generation without a word",
        "mileage/rollout/engines/http.py",
        "for url in sorted(left_out):",
        "for url in sorted(left_out - left_out):",
        (
            "tests/test_sglang_client.py::"
            "test_a_server_left_out_of_generation_is_named_once_and_when_it_is_back",
        ),
    ),
    Mutant(
        "recipe-ds-judged-past-the-cpu-budget",
        "the dynamic-sampling arm of the paired recipe is judged by wall time alone",
        "scripts/recipe_ds_paired.py",
        'within = [c for c in commits if c["wall_s"] <= wall and c["cpu_s"] <= cpu]',
        'within = [c for c in commits if c["wall_s"] <= wall]',
        ("tests/test_recipe_ds_paired.py::test_judged_commit_the_cpu_budget_binds",),
    ),
    Mutant(
        "recipe-ds-zero-variance-miscounted",
        "a group counts as zero-variance when its first two rewards are equal",
        "scripts/recipe_ds_paired.py",
        "zero += all(r == group[0] for r in group)",
        "zero += group[0] == group[1]",
        ("tests/test_recipe_ds_paired.py::test_group_counts_zero_variance_and_exact",),
    ),
    Mutant(
        "packed-weight-outlives-its-batch",
        "the oneDNN copies of generation's weights are kept across batches, so a batch after an "
        "optimizer step samples from the weights before it",
        "mileage/models/packed.py",
        "        if not outer:\n            _state.cache = None\n",
        "        pass\n",
        (
            "tests/test_packed.py::test_a_weight_changed_between_contexts_is_reordered_again",
            "tests/test_lm_head.py::"
            "test_the_heads_packed_weight_is_made_once_per_context_and_sees_a_changed_weight",
        ),
    ),
    Mutant(
        "packed-linear-under-autocast",
        "a bf16 forward inside generation multiplies in fp32 on the reordered weight",
        "mileage/models/packed.py",
        "if x.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):",
        "if x.dtype == torch.float32:",
        ("tests/test_packed.py::test_autocast_and_other_threads_take_the_stock_path",),
    ),
    Mutant(
        "packed-copies-of-sharded-weights",
        "generation reorders a full copy of FSDP-sharded weights on every rank",
        "mileage/models/packed.py",
        "if not outer and (model is None or _plain_parameters(model)):",
        "if not outer:",
        ("tests/test_packed.py::test_a_model_with_sharded_parameters_keeps_the_stock_path",),
    ),
    Mutant(
        "packed-small-weights-too",
        "generation reorders weights under 1 MiB too, where oneDNN was slower than the stock path",
        "mileage/models/packed.py",
        "            and weight.numel() * weight.element_size() >= MIN_BYTES\n",
        "",
        ("tests/test_packed.py::test_weights_under_the_threshold_keep_the_stock_path",),
    ),
    Mutant(
        "shared-prefill-rows-misassigned",
        "samples of repeated prompts continue from the shared prefill rows in sorted order, so a "
        "sample's cache can be another prompt's",
        "mileage/rollout/engine.py",
        "            rows = torch.tensor(row_of, device=device)\n",
        "            rows = torch.tensor(sorted(row_of), device=device)\n",
        (
            "tests/test_engine.py::"
            "test_repeated_prompts_share_one_prefill_row_and_keep_their_own_samples",
        ),
    ),
    Mutant(
        "prefill-not-shared",
        "every sample of a repeated prompt is prefilled again",
        "mileage/rollout/engine.py",
        "row_of = [first_row.setdefault(tuple(p), len(first_row)) for p in prompts]",
        "row_of = [first_row.setdefault((i, *p), len(first_row)) for i, p in enumerate(prompts)]",
        (
            "tests/test_engine.py::"
            "test_repeated_prompts_share_one_prefill_row_and_keep_their_own_samples",
        ),
    ),
    Mutant(
        "shared-prompt-gradient-dropped",
        "the training forward's shared prompt rows are detached, so no gradient reaches the "
        "prompt tokens' activations through the samples",
        "mileage/training/shared_prompt.py",
        "        expand_rows(cache, rows)\n",
        "        expand_rows(cache, rows)\n"
        "        for layer in cache.layers:\n"
        "            layer.keys, layer.values = layer.keys.detach(), layer.values.detach()\n",
        (
            "tests/test_shared_prompt.py::"
            "test_same_logprobs_entropies_and_gradients_as_the_plain_forward",
        ),
    ),
    Mutant(
        "shared-prompt-positions-off-by-one",
        "each sample's own tokens run one position later than in its sequence",
        "mileage/training/shared_prompt.py",
        "position_ids=starts[:, None] + steps,",
        "position_ids=starts[:, None] + steps + 1,",
        (
            "tests/test_shared_prompt.py::"
            "test_same_logprobs_entropies_and_gradients_as_the_plain_forward",
        ),
    ),
    Mutant(
        "shared-prompt-rows-misassigned",
        "the training forward gives samples the shared prompt rows in sorted order, so a "
        "sample can attend to another prompt",
        "mileage/training/shared_prompt.py",
        "    rows = torch.tensor(row_of, device=device)\n",
        "    rows = torch.tensor(sorted(row_of), device=device)\n",
        (
            "tests/test_shared_prompt.py::"
            "test_same_logprobs_entropies_and_gradients_as_the_plain_forward",
        ),
    ),
    Mutant(
        "shared-prompt-never-used",
        "the training forward computes every sample's prompt again",
        "mileage/training/shared_prompt.py",
        "    if len(first_row) == len(row_of):\n",
        "    if True:\n",
        (
            "tests/test_shared_prompt.py::"
            "test_each_distinct_prompt_runs_once_then_each_sample_from_its_last_prompt_token",
        ),
    ),
    Mutant(
        "shared-prompt-under-fsdp",
        "a sharded (FSDP2) model runs the prompt pass and the samples' pass before one backward",
        "mileage/training/shared_prompt.py",
        "    return any(type(p.data) is not torch.Tensor for p in parameters)",
        "    return False",
        ("tests/test_shared_prompt.py::test_sharded_parameters_mean_one_plain_forward",),
    ),
    Mutant(
        "shared-prompt-caches-bf16-casts",
        "both passes of the shared-prompt forward use autocast's cached bf16 weight casts, so "
        "whether their gradients meet in bf16 depends on autocast in other threads",
        "mileage/training/shared_prompt.py",
        "    with autocast(model, cache_casts=False):",
        "    with autocast(model, cache_casts=True):",
        (
            "tests/test_shared_prompt.py::"
            "test_bf16_gradients_do_not_depend_on_autocast_in_other_threads",
        ),
    ),
    Mutant(
        "chunked-head-as-checkpointed-chunks",
        "the chunked LM head runs each chunk as a checkpointed autograd node again, so whether "
        "the chunks share autocast's bf16 cast of the weight depends on other threads",
        "mileage/training/logprobs.py",
        "        out = ChunkedHead.apply(flat, flat_targets, *args, chunk_tokens)",
        "        from torch.utils.checkpoint import checkpoint\n\n"
        "        pieces = [\n"
        "            checkpoint(_chunk_logprobs, flat[a : a + chunk_tokens],\n"
        "                       flat_targets[a : a + chunk_tokens], *args, use_reentrant=False)\n"
        "            for a in range(0, rows, chunk_tokens)\n"
        "        ]\n"
        "        out = torch.cat(pieces)",
        (
            "tests/test_shared_prompt.py::"
            "test_bf16_gradients_do_not_depend_on_autocast_in_other_threads",
        ),
    ),
    Mutant(
        "chunked-head-keeps-one-chunks-weight-gradient",
        "the chunked head's backward keeps the first chunk's weight gradient and drops the others'",
        "mileage/training/logprobs.py",
        "        return total.addmm_(a, b)",
        "        return total",
        (
            f"{CHUNKED}::test_chunked_log_probs_entropies_and_gradients_equal_the_unchunked_ones",
            f"{CHUNKED}::test_the_chunked_heads_gradients_are_the_derivatives",
        ),
    ),
    Mutant(
        "gated-silu-up-gradient-without-silu",
        "the gated MLP's backward multiplies the up projection's gradient by the gate, not SiLU(gate)",
        "mileage/models/gated_mlp.py",
        "        grad_up = grad * F.silu(gate)",
        "        grad_up = grad * gate",
        (
            "tests/test_gated_mlp.py::test_the_gated_mlp_gives_the_transformers_modules_numbers_bit_for_bit",
            "tests/test_gated_mlp.py::test_gated_silus_gradients_are_the_derivatives",
        ),
    ),
    Mutant(
        "policy-without-gated-silu",
        "the policy keeps the transformers MLP forward (the same numbers, one more tensor kept)",
        "mileage/build.py",
        "    use_gated_silu(model)",
        "    pass",
        ("tests/test_lm_head.py::test_a_bf16_run_builds_its_policy_with_the_switch_and_says_so",),
    ),
    Mutant(
        "collector-left-off-for-the-run",
        "the mileage process never turns the cyclic collector back on after its imports",
        "mileage/cli/main.py",
        "    gc.freeze()\n    gc.enable()\n",
        "    gc.freeze()\n",
        (
            "tests/test_cli_startup.py::"
            "test_the_process_collects_nothing_while_importing_and_freezes_what_it_imported",
        ),
    ),
    Mutant(
        "killed-runs-weights-never-swept",
        "a killed run's temporary weights directory stays in /tmp for ever",
        "mileage/rollout/engines/weights.py",
        "                remove_orphaned_weights()\n",
        "",
        (
            "tests/test_engines_vllm.py::"
            "test_a_killed_runs_temporary_weights_are_removed_by_the_next_run",
        ),
    ),
    Mutant(
        "allocator-tuning-overrides-the-users",
        "the mileage process turns glibc's mmap off even where the user tuned malloc",
        "mileage/allocator.py",
        "or any(os.environ.get(k) for k in _USER_TUNING)",
        "or False",
        ("tests/test_allocator.py::test_a_users_own_malloc_tuning_is_left_alone",),
    ),
    Mutant(
        "allocator-trims-again",
        "freed memory goes back to the kernel at the heap's top, so blocks fault in again",
        "mileage/allocator.py",
        "mallopt(M_TRIM_THRESHOLD, -1) == 1",
        "mallopt(M_TRIM_THRESHOLD, 0) == 1",
        ("tests/test_allocator.py::test_freed_blocks_are_reused_instead_of_faulting_in_again",),
    ),
    Mutant(
        "serve-takes-infinite-sampling-params",
        "mileage serve samples with an infinite or NaN temperature/top_p",
        "mileage/serve/requests.py",
        "not isinstance(value, (int, float)) or not math.isfinite(value):",
        "not isinstance(value, (int, float)):",
        (
            "tests/test_bad_input_serve.py::"
            "test_every_bad_request_field_is_refused_naming_the_field",
        ),
    ),
    Mutant(
        "serve-reads-any-announced-body",
        "mileage serve reads a body of whatever size a Content-Length announces",
        "mileage/serve/requests.py",
        "    if len(raw) > 18 or int(raw) > limit:\n",
        "    if False:\n",
        (
            "tests/test_bad_input_serve.py::"
            "test_bad_requests_and_bodies_get_an_answer_and_the_connection_is_kept",
        ),
    ),
    Mutant(
        "serve-loads-another-model",
        "mileage serve's weight update swaps in a model of another vocabulary or architecture",
        "mileage/serve/server.py",
        "            self._refuse_another_model(path, model)\n",
        "",
        (
            "tests/test_bad_input_serve.py::"
            "test_a_weight_update_of_another_model_is_refused_and_the_old_weights_serve",
        ),
    ),
    Mutant(
        "hook-timeout-never-fires",
        "a user function (reward, generate) that hangs is never stopped by --hook-timeout",
        "mileage/rollout/userfn.py",
        "if c.own(now) > self.hook.timeout]",
        "if False]",
        (
            "tests/test_hooks.py::test_a_hung_reward_is_stopped_by_the_hook_timeout",
            "tests/test_hooks.py::"
            "test_a_generate_function_blocking_its_event_loop_is_stopped_by_the_timeout",
        ),
    ),
    Mutant(
        "null-label-read-as-none",
        'a JSONL label of null becomes the string "None": every reward 0, silently',
        "mileage/rollout/prompts.py",
        '    if value is None:\n        raise UserError(\n            f"{where}: {label_key!r} is null',
        '    if False:\n        raise UserError(\n            f"{where}: {label_key!r} is null',
        (
            "tests/test_bad_input_data.py::test_a_null_jsonl_value_is_refused_naming_file_line_and_key",
            "tests/test_bad_input_data.py::test_a_null_parquet_label_names_the_row",
        ),
    ),
    Mutant(
        "non-utf8-jsonl-traceback",
        "a byte that is not UTF-8 in a JSONL file ends in a UnicodeDecodeError traceback",
        "mileage/rollout/prompts.py",
        "    except UnicodeDecodeError as exc:\n",
        "    except KeyError as exc:\n",
        ("tests/test_bad_input_data.py::test_a_byte_that_is_not_utf8_names_file_line_and_column",),
    ),
    Mutant(
        "hf-config-types-unchecked",
        'config.json\'s sizes are not type-checked ("hidden_size": "big", 0 layers pass on)',
        "mileage/models/hf.py",
        "    check_field_types(config, file)\n",
        "",
        ("tests/test_bad_input_data.py::test_a_config_field_of_the_wrong_type_is_one_line",),
    ),
    Mutant(
        "eval-mean-reward-called-accuracy",
        "the evaluation line calls the mean reward accuracy and hides the share solved",
        "mileage/rollout/evaluation.py",
        "        text = f\"reward {metrics[key]:.3f} solved {metrics[f'{key}/pass@1']:.3f}\"\n",
        '        text = f"accuracy {metrics[key]:.3f}"\n',
        (
            "tests/test_output_names.py::test_a_weighted_rubric_evaluates_as_reward_1_and_half_solved",
        ),
    ),
    Mutant(
        "async-rate-charges-whole-slots",
        "train-async's tok/s charges a group its whole slot's generation time",
        "mileage/sources/ahead.py",
        "        seconds += busy * count / slot_tokens if slot_tokens else 0.0\n",
        "        seconds += busy\n",
        (
            "tests/test_output_names.py::test_async_throughput_is_tokens_over_the_generators_busy_time_not_the_wait",
        ),
    ),
    Mutant(
        "restored-line-full-digest",
        "the restored line prints the data digest's 64 hex digits",
        "mileage/progress.py",
        "data['digest'][:8]",
        "data['digest']",
        (
            "tests/test_output_names.py::test_the_restored_line_says_what_from_which_iteration_with_a_short_digest",
        ),
    ),
    Mutant(
        "own-model-defaults-silent",
        "with --hf-checkpoint the plan does not say that miles' defaults (lr 1e-6) replace the demo's",
        "mileage/run_config.py",
        "        if self.miles_defaults:\n",
        "        if False:\n",
        ("tests/test_output_names.py::test_the_plan_names_the_defaults_that_apply_demo_or_miles",),
    ),
    Mutant(
        "nan-checkpoint-committed",
        "the finiteness check before a commit is removed: a NaN checkpoint becomes the tracked one",
        "mileage/loop.py",
        "            check_checkpoint(snapshot)  # a NaN checkpoint never becomes the tracked one",
        "            pass",
        (
            "tests/test_nonfinite.py::"
            "test_a_nan_injected_stops_before_anything_is_committed[checkpoint before commit]",
        ),
    ),
    Mutant(
        "nan-gradient-applied",
        "a NaN/inf loss or gradient is applied by the optimizer step",
        "mileage/training/actor.py",
        "        if not loss_anywhere and math.isfinite(float(norm)):",
        "        if True:",
        ("tests/test_nonfinite.py",),
    ),
    Mutant(
        "missing-tracker-is-a-fresh-start",
        "a save directory whose tracker was deleted starts fresh (and overwrites its checkpoints)",
        "mileage/checkpoint/plan.py",
        "        and flags.ckpt_step is None\n        and load.complete_ids\n",
        "        and flags.ckpt_step is None\n        and False\n",
        (f"{PLAN}::test_a_missing_tracker_resumes_from_the_newest_complete_checkpoint",),
    ),
    Mutant(
        "untracked-checkpoints-overwritten",
        "a fresh start writes over complete checkpoints that no tracker names",
        "mileage/checkpoint/plan.py",
        "(disk.save.tracker.exists and not disk.save.tracker.release) or disk.save.complete_ids",
        "(disk.save.tracker.exists and not disk.save.tracker.release)",
        (f"{PLAN}::test_untracked_complete_checkpoints_are_never_overwritten_by_a_fresh_start",),
    ),
    Mutant(
        "saves-only-at-the-end",
        "with --save and no --save-interval, the run saves only after its last rollout",
        "mileage/checkpoint/schedule.py",
        "    every = max(1, math.ceil(num_rollout / DEFAULT_SHARE))",
        "    every = None",
        ("tests/test_save_schedule.py",),
    ),
    Mutant(
        "sigterm-exits-0",
        "a run stopped by SIGTERM exits 0, as if it had finished",
        "mileage/cli/train.py",
        "    return STOPPED_EXIT if stop_reason in PreemptionGuard.SIGNAL_NAMES else 0",
        "    return 0",
        (f"{PREEMPT}::test_signal_saves_and_exits_75_then_the_same_command_resumes",),
    ),
    Mutant(
        "agent-completions-wrong-sample",
        "an agent's completions are recorded into the next sample's trajectory",
        "mileage/rollout/agents/session.py",
        "            state.base_url, state.key = self.endpoint.add(self.sample_handler(row))",
        "            state.base_url, state.key = self.endpoint.add(\n"
        "                self.sample_handler((row + 1) % len(self.rows))\n"
        "            )",
        (f"{AGENTS}::test_the_plain_format_matches_the_built_in_tool_loop",),
    ),
    Mutant(
        "agent-history-retokenized",
        "an agent's history is rendered again from its text instead of reusing the engine's ids",
        "mileage/rollout/agents/trajectory.py",
        "                    if appended is not None:\n"
        "                        ids = seg.context() + cand.ids + appended",
        "                    if appended is not None:\n"
        "                        ids = self.renderer.chat(forms, tools)",
        (f"{AGENTS}::test_trajectory_is_the_engine_s_ids_and_the_tool_s",),
    ),
    Mutant(
        "agent-journal-after-divergence",
        "a sample whose agent diverged from the journal still takes journaled completions",
        "mileage/rollout/agents/session.py",
        "            entry = None if state.diverged else self.journal.get(self.slot, self._key(row, call))",
        "            entry = self.journal.get(self.slot, self._key(row, call))",
        (f"{AGENTS}::test_the_journal_replays_a_rerun_and_stops_at_a_divergence",),
    ),
    Mutant(
        "logprob-chunk-targets-misaligned",
        "each chunk of the LM head scores the targets of the positions one row later",
        "mileage/training/logprobs.py",
        "logprob_values(logits, targets[span], temperature, with_entropy)",
        "logprob_values(logits, targets.roll(-1)[span], temperature, with_entropy)",
        (f"{CHUNKED}::test_chunked_log_probs_entropies_and_gradients_equal_the_unchunked_ones",),
    ),
    Mutant(
        "logprob-head-entropy-is-the-logprob",
        "the head's stacked output is read back with the log-prob where the entropy belongs",
        "mileage/training/logprobs.py",
        "    return stacked[..., 0], (stacked[..., 1] if with_entropy else None)",
        "    return stacked[..., 0], (stacked[..., 0] if with_entropy else None)",
        (f"{CHUNKED}::test_one_chunk_is_the_unchunked_arithmetic_bit_for_bit",),
    ),
    Mutant(
        "memory-resume-rechooses-micro-batch",
        "a resumed run chooses its micro-batch again instead of keeping the one it started with",
        "mileage/preflight.py",
        "        saved = recorded_micro_batch(plan.weights_from) or global_batch // world",
        "        saved = None",
        (f"{MEMORY}::test_a_resume_plans_the_micro_batch_its_checkpoint_records",),
    ),
    Mutant(
        "memory-peak-never-reset",
        "each rollout's peak is the process's lifetime peak",
        "mileage/training/memory_use.py",
        '            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)',
        "            pass",
        (f"{MEMORY}::test_peak_is_reset_per_rollout_and_recorded_with_the_estimate",),
    ),
    Mutant(
        "recompute-without-rng-state",
        "a checkpointed layer recomputes its forward with the RNG moved on (other dropout masks)",
        "mileage/models/activation_checkpointing.py",
        '                module.activation_checkpointing_enable({"use_reentrant": False})',
        "                module.activation_checkpointing_enable(\n"
        '                    {"use_reentrant": False, "preserve_rng_state": False}\n'
        "                )",
        (f"{RECOMPUTE}::test_checkpointed_gradients_equal_the_kept_ones_with_dropout",),
    ),
    Mutant(
        "recompute-shares-prompt-cache",
        "the shared-prompt forward runs on checkpointed layers, which drop its KV cache",
        "mileage/training/shared_prompt.py",
        "        or (model.training and checkpointed_layers(model))",
        "        or False",
        (f"{RECOMPUTE}::test_checkpointed_training_forward_runs_every_row_whole",),
    ),
    Mutant(
        "opd-teacher-shifted-by-one",
        "the teacher's log-probs are paired with the next token's student log-probs",
        "mileage/training/actor.py",
        "            teacher = self._frozen_logprobs(self.teacher, batch, batching)\n",
        "            teacher = torch.roll(self._frozen_logprobs(self.teacher, batch, batching), 1, 1)\n",
        (f"{DISTILL}::test_the_teacher_term_is_the_sampled_reverse_kl_per_response_token",),
    ),
    Mutant(
        "opd-teacher-term-added",
        "the distillation term is added: the student is pushed away from the teacher",
        "mileage/training/distill.py",
        "    return advantages - coef * reverse_kl, mean\n",
        "    return advantages + coef * reverse_kl, mean\n",
        (f"{DISTILL}::test_distill_advantages_by_hand",),
    ),
    Mutant(
        "opd-served-teacher-off-by-one",
        "the served teacher is asked from the first response token: its scores shift by one",
        "mileage/rollout/teacher.py",
        "                start = len(s.prompt_ids) - 1\n",
        "                start = len(s.prompt_ids)\n",
        (f"{SERVED_TEACHER}::test_the_served_teacher_s_scores_land_on_the_response_tokens",),
    ),
    Mutant(
        "opd-served-teacher-not-replayed",
        "a resumed rollout asks the teacher server again instead of reading the journal",
        "mileage/rollout/teacher.py",
        '            if entry is not None and entry.get("ids") == _ids_digest(ids):\n',
        "            if False:\n",
        (f"{SERVED_TEACHER}::test_a_resumed_rollout_reads_the_teacher_from_the_journal",),
    ),
    Mutant(
        "sft-loss-on-prompt-tokens",
        "SFT trains the user turns and role markers of a conversation, not only its answers",
        "mileage/rollout/sft.py",
        "        mask += [0] * (len(before) - len(ids)) + [int(assistant)] * (len(after) - len(before))\n",
        "        mask += [1] * (len(before) - len(ids)) + [int(assistant)] * (len(after) - len(before))\n",
        (f"{SFT}::test_a_conversation_trains_its_assistant_turns_only",),
    ),
    Mutant(
        "sft-stage-not-recorded",
        "an SFT checkpoint does not say so: `mileage train --load` of it resumes its optimizer and data",
        "mileage/components.py",
        "            **stage_meta(run.plan.stage),  # only SFT runs record theirs\n",
        "            **{},\n",
        (f"{SFT}::test_train_starts_rl_from_an_sft_run_and_a_rerun_resumes_its_own_save",),
    ),
    Mutant(
        "opd-teacher-unverified",
        "the teacher checkpoint loads without the integrity check",
        "mileage/build.py",
        "    return [(plan.weights_from, plan.weights_format), reference, critic, teacher]\n",
        "    return [(plan.weights_from, plan.weights_format), reference, critic]\n",
        (f"{DISTILL}::test_a_damaged_teacher_is_refused_before_anything_loads",),
    ),
    Mutant(
        "judge-score-replayed-for-wrong-sample",
        "a rerun reads a round's journaled judge scores back in the wrong order: each sample "
        "trains on another sample's reward",
        "mileage/rollout/rewards/journaled.py",
        '        return [float(e["reward"]) for e in entries if e is not None]\n',
        '        return [float(e["reward"]) for e in reversed(entries) if e is not None]\n',
        (
            f"{JUDGE}::test_journaled_rewards_replay_only_for_the_samples_they_were_given_to",
            f"{JUDGE_CRASH}::test_a_sampling_judge_s_scores_are_replayed_from_the_journal_after_a_kill",
        ),
    ),
    Mutant(
        "judge-replay-ignores-the-sample",
        "a journaled reward is replayed for whatever sample now sits at its place",
        "mileage/rollout/rewards/journaled.py",
        '    if all(e is not None and e.get("sample") == d for e, d in zip(entries, digests, strict=True)):\n',
        "    if all(e is not None for e in entries):\n",
        (f"{JUDGE}::test_journaled_rewards_replay_only_for_the_samples_they_were_given_to",),
    ),
    Mutant(
        "judge-not-journaled",
        "a judge's (or reward server's) scores are not journaled: a rerun asks again",
        "mileage/rollout/rewards/journaled.py",
        '    return isinstance(fn, UserReward | RemoteReward) or bool(getattr(fn, "journaled", False))\n',
        '    return isinstance(fn, UserReward) or bool(getattr(fn, "journaled", False))\n',
        (
            f"{JUDGE_CRASH}::test_a_sampling_judge_s_scores_are_replayed_from_the_journal_after_a_kill",
        ),
    ),
    Mutant(
        "judge-unreadable-reply-scored-zero",
        "a judge reply without a score counts as 0 instead of stopping the run",
        "mileage/rollout/rewards/judge.py",
        "    if found is None:\n        raise JudgeReplyError(\n",
        "    if found is None:\n        return 0.0\n        raise JudgeReplyError(\n",
        (
            f"{JUDGE}::test_an_unreadable_reply_is_a_named_failure_never_a_zero",
            f"{JUDGE_CRASH}::test_a_garbage_or_absent_judge_is_one_line_and_exit_2",
        ),
    ),
    Mutant(
        "pack-positions-do-not-restart",
        "a pack's position ids run on across its samples: attention leaks from one sample into "
        "the next (and their rotary positions shift)",
        "mileage/training/packing.py",
        "    position_ids = (steps - offsets.repeat_interleave(lengths)).unsqueeze(0)\n",
        "    position_ids = steps.unsqueeze(0)\n",
        (f"{PACKING}::test_no_attention_crosses_samples_in_a_pack",),
    ),
    Mutant(
        "varlen-attention-ignores-bounds",
        "mileage_sdpa runs a packed row's attention as one causal sequence, across its samples",
        "mileage/models/attention.py",
        "    edges = bounds.tolist()\n",
        "    edges = [0, query.shape[2]]\n",
        (f"{PACKING}::test_packed_loss_and_gradients_equal_the_padded_ones",),
    ),
    Mutant(
        "packed-micro-batch-count-not-agreed",
        "under torchrun each rank runs as many packed micro-batches as its own share needs: "
        "FSDP2's backwards no longer pair up",
        "mileage/training/packing.py",
        "            count = max(ranks.all_gather_object(len(ranges)))\n",
        "            count = len(ranges)\n",
        (f"{PACKING}::test_every_rank_runs_as_many_micro_batches",),
    ),
    Mutant(
        "packed-logprobs-one-position-late",
        "a packed micro-batch scores each target from the position after the one predicting it",
        "mileage/training/packing.py",
        "        positions=offsets[rows] + columns,\n",
        "        positions=offsets[rows] + columns + 1,\n",
        (f"{PACKING}::test_packed_loss_and_gradients_equal_the_padded_ones",),
    ),
    Mutant(
        "old-actor-swap-not-undone",
        "--keep-old-actor recomputes with a kept version swapped into the policy and leaves it "
        "there: the policy trains on from old weights",
        "mileage/distributed/parallelize.py",
        "            _local(params[name]).copy_(value)\n",
        "            pass\n",
        (
            "tests/test_async.py::"
            "test_keep_old_actor_recomputes_each_row_with_the_weights_that_generated_it",
        ),
    ),
    Mutant(
        "open-turn-forgotten",
        "--partial-rollout with tools: a turn a round's budget cut is continued as if it were a "
        "new turn, so its tool call is read from its last piece only",
        "mileage/rollout/multiturn.py",
        "    open_ids = response[len(response) - sample.open_turn :] if sample.open_turn else []\n",
        "    open_ids = []\n",
        (PARTIAL_TOOLS, PARTIAL_TOOLS_ROUNDS),
    ),
    Mutant(
        "round-budget-ignored-by-tool-loop",
        "--partial-rollout with tools: a trajectory samples whole turns whatever the round's "
        "token budget, so nothing is ever aborted at the batch",
        "mileage/rollout/multiturn.py",
        "        cut = budget is not None and budget < cap  #",
        "        cut = False  #",
        (PARTIAL_TOOLS, PARTIAL_TOOLS_ROUNDS, PARTIAL_TOOLS_SERVE),
    ),
    Mutant(
        "open-turn-not-checkpointed",
        "an in-flight trajectory's open turn is lost when the buffer is saved and restored",
        "mileage/rollout/sample.py",
        '"tool_calls": calls})',
        '"tool_calls": calls, "open_turn": 0})',
        (PARTIAL_TOOLS_ROUNDS, PARTIAL_TOOLS_SERVE),
    ),
    Mutant(
        "reward-cut-off-answer-escapes",
        "a reward or judge server that breaks off its answer escapes as "
        "`http.client.IncompleteRead` (a traceback, exit 1)",
        "mileage/rollout/rewards/remote.py",
        "        except http.client.HTTPException as exc:\n",
        "        except ZeroDivisionError as exc:\n",
        (
            "tests/test_rewards_remote.py::test_bad_servers_end_in_one_user_error_after_bounded_retries",
        ),
    ),
    Mutant(
        "offload-policy-dropped",
        "--fsdp-cpu-offload is accepted but FSDP2 is never given the offload policy: the "
        "shards and optimizer state stay in GPU memory",
        "mileage/distributed/parallelize.py",
        '        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device().type == "cuda")\n',
        "        pass\n",
        (
            "tests/test_offload.py::"
            "test_checkpoints_move_between_offloaded_and_resident_shards_bit_for_bit",
        ),
    ),
    Mutant(
        "colocate-sync-skips-last-tensor",
        "--colocate hands the engine every tensor but the last (the untied LM head): the engine "
        "samples with a stale head",
        "mileage/rollout/engines/colocated.py",
        "        yield name, tensor.detach().to(dtype)\n",
        "        if index < len(state) - 1:\n            yield name, tensor.detach().to(dtype)\n",
        (
            "tests/test_colocate.py::"
            "test_a_colocated_run_syncs_in_memory_and_killed_anywhere_lands_on_the_uninterrupted_run",
        ),
    ),
    Mutant(
        "colocate-engine-reseeds-the-trainer",
        "vLLM's start (seed=0) reseeds the trainer's global generators: the run's random "
        "stream no longer follows --seed",
        "mileage/rollout/engines/colocated.py",
        "            with kept_rng():\n                self.llm = self.vllm.LLM(",
        "            with contextlib.nullcontext():\n                self.llm = self.vllm.LLM(",
        ("tests/test_colocate.py::test_the_engine_leaves_the_trainer_s_random_states_alone",),
    ),
    Mutant(
        "colocate-torchrun-rows-seeded-by-rank",
        "under torchrun each rank's colocated engine seeds its share of the rows by their place "
        "in the share, not in the whole call: rank 1 redraws rank 0's samples' randomness",
        "mileage/distributed/colocated.py",
        "        part = None if seed is None else RowsOf(seed, tuple(mine))\n",
        "        part = seed\n",
        (
            "tests/test_colocate.py::"
            "test_under_torchrun_every_rank_s_engine_takes_the_gathered_weights_in_memory",
        ),
    ),
    Mutant(
        "colocate-woken-without-its-cache",
        "the colocated engine's update wakes its weights after sleep mode but not its KV cache: "
        "the next rollout's generation has no cache to run in",
        "mileage/rollout/engines/colocated.py",
        '                self.llm.wake_up(tags=["kv_cache"])\n',
        "                pass\n",
        (
            "tests/test_colocate.py::"
            "test_a_colocated_run_syncs_in_memory_and_killed_anywhere_lands_on_the_uninterrupted_run",
        ),
    ),
    Mutant(
        "ahead-rollout-functions-draw-at-once",
        "train-async runs the user's rollout function of a slot without waiting for the slot "
        "before it: two slots draw from the data at once, in an order set by timing",
        "mileage/sources/producer.py",
        "        if previous is not None:\n            wait([previous])\n",
        "        if previous is not None and previous.done():\n            wait([previous])\n",
        (
            "tests/test_async.py::"
            "test_a_rollout_function_s_slots_draw_one_after_another_retries_first",
        ),
    ),
    Mutant(
        "ahead-partial-rollout-saves-no-groups-in-flight",
        "train-async with --partial-rollout leaves the groups still in flight out of the "
        "rollout buffer it saves: a resumed run starts them afresh",
        "mileage/sources/producer.py",
        "                self.buffer.partial = deque(result.in_flight)\n",
        "                self.buffer.partial = deque()\n",
        (
            "tests/test_compose_pairs.py::"
            "test_partial_rollout_ahead_killed_anywhere_lands_on_the_uninterrupted_run",
        ),
    ),
    Mutant(
        "ahead-rollout-function-loses-unused-retries",
        "train-async drops the retried prompts a slot's rollout function did not draw",
        "mileage/sources/producer.py",
        "            self.buffer.retry = result.unused_retries + self.buffer.retry\n",
        "            pass\n",
        (
            "tests/test_async.py::"
            "test_a_rollout_function_s_slots_draw_one_after_another_retries_first",
        ),
    ),
]

_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def scratch_copy(destination: Path) -> None:
    """The committed tree (HEAD), as CI would see it."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)


def plant(root: Path, mutant: Mutant) -> None:
    path = root / mutant.file
    text = path.read_text()
    count = text.count(mutant.find)
    if count != 1:
        raise SystemExit(
            f"mutant {mutant.name}: its snippet occurs {count} times in {mutant.file}; update it"
        )
    path.write_text(text.replace(mutant.find, mutant.replace))


def run_mutant(
    mutant: Mutant | None, home: str, timeout: float, tests: tuple[str, ...] = ()
) -> tuple[Mutant | None, str, list[str], float]:
    """Run `mutant.tests` (or `tests`, for the baseline: mutant None) against a scratch copy."""
    started = time.monotonic()
    name = mutant.name if mutant else "baseline"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as scratch:
        root = Path(scratch)
        scratch_copy(root)
        if mutant is not None:
            plant(root, mutant)
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "MILEAGE_TEST_HOME": home,
            "OMP_NUM_THREADS": "1",
        }
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
        ]
        try:
            done = subprocess.run(
                [*command, *(mutant.tests if mutant else tests)],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return mutant, "timed out", [], time.monotonic() - started
    catchers = sorted(set(_FAILED.findall(done.stdout)))
    if done.returncode == 0:
        verdict = "SURVIVED"
    elif done.returncode == 1 and catchers:
        verdict = "caught"
    else:
        verdict = f"pytest exited {done.returncode}"
        catchers = catchers or [done.stdout.strip().splitlines()[-1] if done.stdout else ""]
    return mutant, verdict, catchers, time.monotonic() - started


def table(rows: list[tuple[Mutant, str, list[str], float]]) -> str:
    lines = [
        "| mutant | planted bug | file | verdict | caught by |",
        "|---|---|---|---|---|",
    ]
    for mutant, verdict, catchers, _ in rows:
        caught_by = "<br>".join(f"`{c}`" for c in catchers) or "-"
        lines.append(
            f"| {mutant.name} | {mutant.what} | `{mutant.file}` | {verdict} | {caught_by} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    parser.add_argument("--out", help="write the table as markdown here")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per mutant")
    parser.add_argument(
        "--home", default=os.environ.get("MILEAGE_TEST_HOME") or tempfile.mkdtemp(),
        help="MILEAGE_HOME shared by the runs, so the built-in model is built once",
    )  # fmt: skip
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not first run the tests unmutated"
    )
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants: {', '.join(sorted(unknown))}")
    started = time.monotonic()
    if not args.skip_baseline:
        # a test that fails without any mutant would make every mutant look caught
        selected = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        _, verdict, failures, seconds = run_mutant(None, args.home, args.timeout, selected)
        print(f"baseline (no mutant): {len(selected)} selections in {seconds:.0f}s")
        if verdict != "SURVIVED":  # "survived" = every selected test passed
            raise SystemExit(f"the tests fail without a mutant ({verdict}): {', '.join(failures)}")
    rows = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(lambda m: run_mutant(m, args.home, args.timeout), chosen):
            mutant, verdict, catchers, seconds = row
            print(f"{mutant.name}: {verdict} in {seconds:.0f}s by {', '.join(catchers) or '-'}")
            rows.append(row)
    survived = [m.name for m, verdict, _, _ in rows if verdict != "caught"]
    report = table(rows)
    summary = (
        f"{len(rows) - len(survived)} of {len(rows)} mutants caught "
        f"in {time.monotonic() - started:.0f}s"
        + (f"; not caught: {', '.join(survived)}" if survived else "")
    )
    print(report)
    print(summary)
    if args.out:
        Path(args.out).write_text(f"{report}\n\n{summary}\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
