"""Checkpoint subcommands: `ckpt ls`, `ckpt verify`, `convert`, `export-hf`."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _save_dir(path: str) -> str:
    from mileage.errors import UserError

    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path} is a file, not a save directory")
    return path


def _ls(args: argparse.Namespace) -> int:
    from mileage.checkpoint.inspect import list_checkpoints

    _save_dir(args.dir)
    rows = list_checkpoints(args.dir, digests=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'name':<14} {'rollout':>7} {'size':>10} {'complete':>8} {'tracked':>7}  model_digest      optimizer_digest"
    )
    for row in rows:
        rollout = "-" if row["rollout_id"] is None else row["rollout_id"]
        print(
            f"{row['name']:<14} {rollout:>7} {row['size_bytes'] / 1e6:>8.1f}MB {str(row['complete']):>8} "
            f"{'*' if row['tracked'] else '':>7}  {(row['model_digest'] or '-')[:16]:<16}  "
            f"{(row['optimizer_digest'] or '-')[:16]}"
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from mileage.checkpoint.inspect import verify_save_dir

    _save_dir(args.dir)
    checked, problems = verify_save_dir(args.dir, args.ckpt_step)
    for problem in problems:
        print(f"CORRUPT {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {len(checked)} checkpoint(s) verified ({', '.join(checked) or 'none'})")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from mileage.checkpoint.hf_export import write_release
    from mileage.cli.paths import require_creatable_dir

    _save_dir(args.save)
    require_creatable_dir(args.save, "--save")
    path = write_release(args.hf_checkpoint, args.save)
    print(
        f"wrote {path} (tracker: release); start from it with --megatron-to-hf-mode raw --ref-load {args.save}"
    )
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mileage.checkpoint.hf_export import export_hf
    from mileage.checkpoint.meta import recorded_model_dir, selected_checkpoint
    from mileage.cli.paths import require_creatable_dir
    from mileage.models.hf import check_export_target

    check_export_target(Path(args.out))
    require_creatable_dir(args.out, "--out")
    checkpoint = selected_checkpoint(args.load, args.ckpt_step, "--ckpt-step")
    config_dir = args.hf_checkpoint or recorded_model_dir(
        checkpoint, lambda line: print(line, file=sys.stderr)
    )
    out = export_hf(checkpoint, config_dir, args.out, adapter_only=args.adapter_only)
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    # the commands' help lines are in mileage.cli.main.COMMANDS
    ckpt = sub.add_parser("ckpt")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=type(ckpt))
    ls = ckpt_sub.add_parser("ls", help="list checkpoints with digests")
    ls.add_argument("dir")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_ls)
    verify = ckpt_sub.add_parser(
        "verify", help="check manifests and checksums (exit 1 on corruption)"
    )
    verify.add_argument("dir")
    verify.add_argument("--ckpt-step", type=int)
    verify.set_defaults(func=_verify)

    convert = sub.add_parser("convert")
    convert.add_argument("--hf-checkpoint", required=True)
    convert.add_argument("--save", required=True)
    convert.set_defaults(func=_convert)

    export = sub.add_parser("export-hf")
    export.add_argument("--load", required=True)
    export.add_argument("--ckpt-step", type=int)
    export.add_argument(
        "--hf-checkpoint",
        help="config and tokenizer to export with (default: the model the checkpoint records "
        "it was trained from)",
    )
    export.add_argument("--out", required=True)
    export.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA checkpoint: write the adapter in PEFT's format instead of the merged model",
    )
    export.set_defaults(func=_export_hf)
