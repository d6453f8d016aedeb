"""`mileage` command line: train, plan, eval, ckpt, convert, export-hf, plot.

Every user error (bad flag, missing file, refused checkpoint state) is printed as one line
`mileage: error: ...` with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import sys

from mileage.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _cmd_train(args: argparse.Namespace) -> int:
    from mileage.run_config import RunConfig

    cfg = RunConfig.from_args(args)
    from mileage.cli.train import train_command

    return train_command(cfg)


def _cmd_train_async(args: argparse.Namespace) -> int:
    from mileage.run_config import RunConfig

    cfg = RunConfig.from_args(args)
    from mileage.cli.train import train_command

    return train_command(cfg, asynchronous=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    from mileage.preflight import preflight, with_recorded_model
    from mileage.run_config import RunConfig

    cfg = with_recorded_model(RunConfig.from_args(args), lambda line: print(line, file=sys.stderr))
    plan = preflight(cfg).plan
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


def build_parser() -> argparse.ArgumentParser:
    from mileage import serve
    from mileage.cli import ckpt_commands, eval_command, model_commands
    from mileage.run_config import RunConfig

    parser = _Parser(prog="mileage", description="RL post-training with exact resume.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="run RL post-training (GRPO / PPO family)")
    RunConfig.add_arguments(train)
    train.set_defaults(func=_cmd_train)

    train_async = sub.add_parser(
        "train-async",
        help="train with generation overlapping training (one-step-off, or --fully-async)",
    )
    RunConfig.add_arguments(train_async, asynchronous=True)
    train_async.set_defaults(func=_cmd_train_async)

    plan = sub.add_parser(
        "plan", help="print the resume plan `train` or `train-async` would follow, and exit"
    )
    RunConfig.add_arguments(plan, asynchronous=True)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=_cmd_plan)

    eval_command.register(sub)
    ckpt_commands.register(sub)
    model_commands.register(sub)
    serve.register(sub)

    plot = sub.add_parser("plot", help="PNG of a run's per-rollout metrics")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return args.func(args)
    except UserError as exc:
        print(f"mileage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("mileage: interrupted", file=sys.stderr)
        return 130


def run() -> int:
    """The `mileage` command as a process of its own: tunes the process, then `main`."""
    from mileage.allocator import keep_freed_memory

    keep_freed_memory()
    return main()


if __name__ == "__main__":
    sys.exit(run())
