"""Every numeric flag of `mileage train` against hostile values: nan, +-inf, -1, 0, 1e8, 10**8,
2**70, "abc" and a seeded draw of random magnitudes. Each ends in one line `mileage: error: ...`
with exit 2, or in a plan (parse, RunConfig validation and preflight all passed), never in a
traceback or a hang.

In-process through `mileage plan`, which runs exactly what `mileage train` runs before it
builds anything (main.py `_cmd_plan`: RunConfig.from_args, then preflight) on the built-in
model, with a small prompt file for training and evaluation (generating the built-in task's
thousands of prompts was most of a plan's time); hypothesis is not a dependency, so the random values come from a seeded generator (the
same values every run: a failure reproduces).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys

import pytest

from mileage.cli.main import build_parser
from mileage.errors import UserError

EDGES = ["nan", "inf", "-inf", "-1", "0", "1e8", str(10**8), str(2**70), "abc"]
SEED = 20240611
RANDOM_PER_FLAG = 1
# seconds one plan may take before the test calls it a hang (a plan takes ~0.05 s)
HANG = 60


def train_actions() -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.parser_of("train")._actions  # built on demand (cli.main._Commands)


def numeric_flags() -> list[str]:
    kinds = {"finite_float", "int64", "float", "int"}
    return sorted(
        a.option_strings[0]
        for a in train_actions()
        if a.option_strings and getattr(a.type, "__name__", None) in kinds
    )


def random_values(rng: random.Random) -> list[str]:
    """Integers and floats of any sign and magnitude, and strings that are neither."""
    out = []
    for _ in range(RANDOM_PER_FLAG):
        kind = rng.choice(("int", "float", "junk"))
        sign = rng.choice((-1, 1))
        if kind == "int":
            out.append(str(sign * rng.randrange(10 ** rng.randint(0, 25))))
        elif kind == "float":
            # exponents past 308 parse as inf
            out.append(f"{sign * rng.uniform(1, 10):.6g}e{rng.randint(-12, 400)}")
        else:
            out.append(rng.choice(("", " ", "1,5", "0x10", "1_000", "--", "½", "1e", "True")))
    return out


def cases() -> list[tuple[str, str]]:
    rng = random.Random(SEED)
    return [(flag, value) for flag in numeric_flags() for value in EDGES + random_values(rng)]


def plan(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """`mileage plan ARGV` as main() runs it, on one parser built once (building train's
    parser is most of the cost of a refused flag): a UserError is the one line, exit 2;
    anything else propagates and fails the test."""
    try:
        args = parser.parse_args(["plan", *argv])
        return args.func(args)
    except UserError as exc:
        print(f"mileage: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _hang(signum, frame):
    raise TimeoutError(f"a plan ran past {HANG} s")


def small_data(tmp_path) -> list[str]:
    """Flags for 64 addition prompts, trained on and evaluated (so eval's checks run too)."""
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{a}+{a + 1}=", "label": str(2 * a + 1)} for a in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--prompt-data", str(path), "--eval-prompt-data", "held", str(path)]


def test_every_numeric_flag_takes_hostile_values_with_one_line_or_a_plan(
    capsys, mileage_home, tmp_path
):
    base = small_data(tmp_path)
    assert plan(build_parser(), base) == 0, capsys.readouterr().err
    flags = numeric_flags()
    assert len(flags) > 50 and "--lr" in flags and "--seed" in flags  # the parser was read
    previous = signal.signal(signal.SIGALRM, _hang)
    outcomes = {0: 0, 2: 0}
    parser = build_parser()
    try:
        for flag, value in cases():
            signal.alarm(HANG)
            code = plan(parser, [*base, f"{flag}={value}"])
            signal.alarm(0)
            err = capsys.readouterr().err
            assert code in (0, 2), (flag, value, code, err)
            outcomes[code] += 1
            if code == 2:
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("mileage: error: "), (flag, value)
                # the line names the flag (or the pair of flags the value conflicts with)
                assert flag in lines[0] or "--" in lines[0], (flag, value, lines[0])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert outcomes[0] and outcomes[2]  # both ends were reached


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_flag_takes_a_non_finite_value(capsys, value):
    floats = [
        a.option_strings[0]
        for a in train_actions()
        if getattr(a.type, "__name__", None) == "finite_float"
    ]
    assert len(floats) > 20
    parser = build_parser()
    for flag in floats:
        assert plan(parser, [f"{flag}={value}"]) == 2
        assert "expected a finite number" in capsys.readouterr().err
