"""`mileage eval --load RUN` (or `--hf-checkpoint DIR`): evaluate a checkpoint without training.

It takes `train`'s flags, so the evaluation flags of a training command (`--eval-prompt-data`,
`--n-samples-per-eval-prompt`, `--eval-temperature`, ...) mean the same here; its `--help`
lists only those evaluation reads (EVAL_SECTIONS). The checkpoint is
the one RUN's tracker names, or `--ckpt-step K`. Nothing is written: not into RUN (no metrics
line, no lock, no tracker points) and nowhere else; the metrics go to stdout.

A sampled evaluation of iter_N draws with the seeds training's evaluation after rollout N drew
(`evaluation.eval_seed`), so on the same machine and flags it reproduces that record's
eval/... values. A LoRA checkpoint is its recorded base with its adapter, as training generated
with it. `--hf-checkpoint DIR` without `--load` evaluates an HF directory (e.g. one `export-hf`
wrote); `--ckpt-step K` then draws with the seeds of training's evaluation after rollout K.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from mileage.errors import UserError

# What `mileage eval --help` lists: the flags evaluation reads. By RunConfig section, all of its
# flags (a name alone) or the named fields; the other train flags are accepted but not listed.
EVAL_SECTIONS: tuple[str | tuple[str, tuple[str, ...]], ...] = (
    ("checkpoint", ("hf_checkpoint", "load", "ckpt_step")),
    (
        "data",
        (
            "eval_prompt_data",
            "eval_input_key",
            "eval_label_key",
            "eval_tool_key",
            "input_key",
            "label_key",
            "tool_key",
            "metadata_key",
            "apply_chat_template",
            "builtin_task",
        ),
    ),
    # the evaluation's sampling defaults to the rollout's
    ("rollout", ("rollout_temperature", "rollout_top_p", "rollout_max_response_len")),
    "engine",
    "multiturn",
    "reward",
    "hooks",
    (
        "eval",
        ("n_samples_per_eval_prompt", "eval_temperature", "eval_top_p", "eval_max_response_len"),
    ),
    ("loop", ("seed", "num_threads")),
    "precision",
)

EVAL_HELP = {
    "load": "the run (save directory) whose checkpoint to evaluate: the one its tracker names",
    "ckpt_step": "evaluate iter_K of --load instead (with --hf-checkpoint alone: draw with the "
    "seeds of training's evaluation after rollout K)",
}


def eval_flags() -> set[str]:
    """The flags of EVAL_SECTIONS, as the command line spells them."""
    import dataclasses

    from mileage.config import flag_of
    from mileage.run_config import SECTIONS

    classes = {name: cls for name, cls, _ in SECTIONS}
    flags = set()
    for entry in EVAL_SECTIONS:
        name, fields = (entry, None) if isinstance(entry, str) else entry
        cls = classes[name]
        if fields is None:
            fields = [f.name for f in dataclasses.fields(cls) if "help" in f.metadata]
        flags.update(flag_of(cls, field) for field in fields)
    return flags


def register(sub) -> None:
    from mileage.run_config import RunConfig

    parser = sub.add_parser(
        "eval",  # its help line is in mileage.cli.main.COMMANDS
        description="Evaluate a checkpoint of --load RUN (or the HF directory --hf-checkpoint) "
        "on --eval-prompt-data, without training; nothing is written. The flags listed are "
        "those evaluation reads; the other `mileage train` flags are accepted too (not listed), "
        "so a training command's flags can be reused as they are.",
    )
    RunConfig.add_arguments(parser)
    shown = eval_flags()
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if (
            action.option_strings
            and action.dest != "help"
            and shown.isdisjoint(action.option_strings)
        ):
            action.help = argparse.SUPPRESS
        elif action.dest in EVAL_HELP:  # training's wording does not fit evaluation
            action.help = EVAL_HELP[action.dest]
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    from mileage.run_config import RunConfig

    task = _recorded_task(args)
    if task and args.prompt_data is None:
        # before the flags resolve: the recorded task's own defaults (its tool loop) apply
        args = argparse.Namespace(**{**vars(args), "builtin_task": task})
    cfg = RunConfig.from_args(args)
    result = evaluate_checkpoint(cfg, lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(describe(result))
    return 0


def _recorded_task(args: argparse.Namespace) -> str | None:
    """The built-in task the selected checkpoint was trained on, if it can be read (what cannot
    is reported by evaluate_checkpoint)."""
    from mileage.checkpoint.meta import recorded_source, selected_checkpoint

    if not args.load:
        return None
    try:
        checkpoint = selected_checkpoint(args.load, args.ckpt_step, "--ckpt-step")
        return (recorded_source(checkpoint) or {}).get("builtin_task")
    except (UserError, OSError, ValueError):
        return None


def evaluate_checkpoint(cfg, log) -> dict:
    """{"checkpoint", "rollout_id", "metrics"} of the checkpoint --load/--ckpt-step selects."""
    from mileage.checkpoint.meta import recorded_model_dir, recorded_source, selected_checkpoint
    from mileage.models.hf import load_tokenizer, read_config_json
    from mileage.precision import set_precision
    from mileage.rollout.agent import DEFAULT_CONTEXT, Agent, load_user_functions
    from mileage.rollout.data import load_eval_sets, task_reward
    from mileage.rollout.engines.factory import build_engine
    from mileage.rollout.evaluation import check_eval_lengths, evaluate
    from mileage.rollout.rewards import build_reward_fn
    from mileage.rollout.rollout import PromptEncoder
    from mileage.rollout.sizes import context_length
    from mileage.seeding import configure_determinism

    ck = cfg.checkpoint
    if not ck.load and not ck.hf_checkpoint:
        raise UserError(
            "mileage eval needs --load RUN (a save directory) or --hf-checkpoint DIR to evaluate"
        )
    if ck.load:
        checkpoint = selected_checkpoint(ck.load, ck.ckpt_step, "--ckpt-step")
    else:
        checkpoint = Path(ck.hf_checkpoint)
    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint} does not exist")
    ignored = [
        flag
        for flag, given in (
            ("--save", ck.save),
            ("--save-hf", ck.save_hf),
            ("--use-wandb", cfg.tracking.use_wandb),
            ("--use-tensorboard", cfg.tracking.use_tensorboard),
        )
        if given
    ]
    if ignored:
        log(f"mileage eval writes nothing: ignoring {', '.join(ignored)}")
    source = (recorded_source(checkpoint) or {}) if ck.load else {}
    data = cfg.data
    if source.get("builtin_task") and not data.prompt_data:
        # the default held-out set is the task the checkpoint was trained on
        data = replace(data, builtin_task=source["builtin_task"])
    eval_sets = load_eval_sets(data)
    if not eval_sets:
        raise UserError("nothing to evaluate: give --eval-prompt-data NAME PATH [NAME PATH ...]")
    reward_fn = build_reward_fn(cfg.reward, task_reward(data), cfg.hooks.hook_timeout)
    config_dir = ck.hf_checkpoint or recorded_model_dir(checkpoint, log)
    configure_determinism(cfg.loop.seed, cfg.loop.num_threads)
    tokenizer = load_tokenizer(config_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    encode = PromptEncoder(tokenizer, data.apply_chat_template)
    check_eval_lengths(read_config_json(config_dir), encode, eval_sets, cfg.eval, cfg.rollout)
    model, meta = _policy(checkpoint, config_dir, bool(ck.load), log)
    set_precision(model, _precision(cfg, meta), cfg.precision.fp32_lm_head)
    rollout_id = meta.get("rollout_id") if ck.load else ck.ckpt_step
    engine = build_engine(
        cfg.engine, model, tokenizer.pad_token_id, tokenizer.eos_token_id, config_dir, log
    )
    agent = None
    if cfg.multiturn.multi_turn:
        # answers go through the run's generate function or tool loop, as in training's evaluation
        agent = Agent(
            cfg,
            load_user_functions(cfg.multiturn, cfg.hooks.hook_timeout),
            tokenizer,
            encode,
            reward_fn,
            None,
            context_length(read_config_json(config_dir)) or DEFAULT_CONTEXT,
        )
    try:
        engine.update_weights(model, int(meta.get("global_step") or 0))
        metrics = evaluate(
            engine,
            encode,
            eval_sets,
            cfg.eval,
            cfg.rollout,
            reward_fn,
            cfg.loop.seed,
            # a release checkpoint is the weights training would start from
            -1 if rollout_id is None else int(rollout_id),
            lambda samples, n: _score(reward_fn, samples, cfg, n),
            agent,
        )
    finally:
        if agent is not None:
            agent.close()
        engine.close()
    return {"checkpoint": str(Path(checkpoint)), "rollout_id": rollout_id, "metrics": metrics}


def _precision(cfg, meta: dict) -> str:
    """The precision training computed in, as the checkpoint records it (fp32 before the
    record), unless --precision/--bf16 ask for one; an HF directory's: --precision resolved."""
    import torch

    from mileage.precision import resolve

    requested = cfg.precision.requested()
    if requested == "auto" and meta:
        return meta.get("precision", "fp32")
    return resolve(requested, torch.device("cpu"))[0]


def _policy(checkpoint: Path, config_dir: str, native: bool, log):
    """(the model training generated with, the checkpoint's meta.json or {} for an HF
    directory); a native checkpoint (and a LoRA checkpoint's native base) is verified first."""
    from mileage.build import load_weights, verify_sources
    from mileage.checkpoint.meta import recorded_lora
    from mileage.models.hf import load_causal_lm

    if not native:
        return load_causal_lm(checkpoint), {}
    sources = [(str(checkpoint), "native")]
    lora = recorded_lora(checkpoint)
    if lora is not None:
        from mileage.training.lora import recorded_base, restore_recorded_policy

        sources.append(recorded_base(str(checkpoint), lora))
    verify_sources(sources)
    load = lambda path, fmt: load_weights(path, fmt, config_dir)  # noqa: E731
    if lora is not None:
        model = restore_recorded_policy(str(checkpoint), load, log).model
    else:
        model = load(str(checkpoint), "native")
    return model, json.loads((checkpoint / "meta.json").read_text())


def describe(result: dict) -> str:
    """The human-readable report: one line per dataset."""
    metrics = result["metrics"]
    lines = [f"checkpoint {result['checkpoint']} (rollout {result['rollout_id']})"]
    for key, value in metrics.items():
        if key.startswith("eval/") and key.count("/") == 1:
            rest = [
                f"{name.rsplit('/', 1)[1]} {metrics[name]:.4g}"
                for name in metrics
                if name.startswith(f"{key}/")
            ]
            lines.append(f"{key[5:]}: reward {value:.4f} | " + " | ".join(rest))
    return "\n".join(lines)


def _score(reward_fn, samples, cfg, group_size: int) -> None:
    """Rewards of any --custom-rm-path form (a function of the whole sample, --group-rm)."""
    from mileage.rollout.rewards import score_samples

    rewards = score_samples(reward_fn, samples, cfg, group_size, cfg.reward.group_rm)
    for sample, reward in zip(samples, rewards, strict=True):
        sample.reward = reward
