"""Prompt files (--prompt-data) fuzzed from valid records: each mutated file is read into prompts
(every prompt and label a str that UTF-8 can hold, as the tokenizer and preflight's byte count
need) or refused with one `UserError` line naming the file, never another exception or a hang.

JSONL: valid records with their values swapped for hostile ones (null, numbers, bools, lists,
dicts, broken message lists, huge and empty strings, a 5000-digit number, nesting past the
recursion limit, lone surrogate escapes), keys missing, added or repeated, lines that are JSON
but not objects, BOM, CRLF, lone CR, blank lines, and then bytes deleted, inserted (non-UTF-8
ones included), flipped and truncated. Parquet: columns of other types, nulls, a missing column,
no rows, and files with bytes flipped or cut.

hypothesis is not a dependency, so the cases come from `random.Random(seed)` for fixed seeds:
the same files every run, and a failure names its seed, case number and offending line.
In-process through `load_prompts` (what `--prompt-data` and `--eval-prompt-data` read files
with); a per-case timer turns a hang into a failure.
"""

from __future__ import annotations

import io
import json
import random
import signal

import pytest

from mileage.errors import UserError
from mileage.rollout.data import load_prompts

SEEDS = (7, 1009, 20240611)
JSONL_CASES = 100  # per seed
PARQUET_CASES = 12  # per seed
# seconds one load may take before the test calls it a hang (a case takes about a millisecond)
HANG = 5.0
REPORTED = 5  # failures shown in full
OK = ("read", "refused")

TEXTS = ["1+1=", "café ∑ 数", "", "  ", "line\nbreak", "tab\there", "🙂", "\u2028", "x" * 300]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
# values as JSON text: what json.dumps cannot write (a number past Python's 4300-digit limit,
# nesting past the recursion limit, NaN, lone surrogate escapes) is written out by hand
RAW = [
    "1" * 5000,
    "-" + "9" * 4301,
    "[" * 100_000 + "]" * 100_000,
    '{"a": ' * 50_000 + "1" + "}" * 50_000,
    "[" * 100,  # unclosed
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0",
    '"\\ud800"',
    '"a\\udc00b"',
    '"\\ud83d\\ude00"',  # a valid pair: 🙂
    '"\\u0000"',
    '"\\"',  # unterminated
    "tru",
    "'single'",
]
HOSTILE = [
    None,
    0,
    -1,
    3.5,
    2**70,
    True,
    False,
    [],
    [1, 2],
    ["a"],
    {},
    {"a": 1},
    "",
    " ",
    "x" * 200_000,
    [{"role": "user"}],
    [{"content": "no role"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [1, {"x": None}]}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    [{"role": "assistant", "content": "a"}],
    [None],
    [[]],
]
NOT_OBJECTS = ["[1,2]", '"x"', "1", "null", "true", "[]", '""', "{}", "[{}]", "{1: 2}", "{"]
BAD_UTF8 = [b"\xff", b"\x80", b"\xc3", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\xc0\xaf", b"\xfe"]


def value_text(rng: random.Random) -> str:
    """A hostile value as JSON text."""
    if rng.random() < 0.25:
        return rng.choice(RAW)
    return json.dumps(rng.choice(HOSTILE))


def good_record(rng: random.Random) -> dict[str, str]:
    """A record the loader reads, as JSON text per key."""
    prompt = rng.choice(TEXTS)
    if rng.random() < 0.2:
        prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    record = {"prompt": json.dumps(prompt), "label": json.dumps(str(rng.randrange(100)))}
    if rng.random() < 0.2:
        record["tools"] = json.dumps(TOOLS)
    if rng.random() < 0.2:
        record["metadata"] = json.dumps({"source": "fuzz", "n": rng.randrange(10)})
    return record


def record_line(rng: random.Random) -> str:
    """One JSONL line's text: a good record, most often with a few of its values or keys
    changed, sometimes JSON that is not an object at all."""
    if rng.random() < 0.08:
        return rng.choice(NOT_OBJECTS)
    record = good_record(rng)
    pairs = list(record.items())
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        kind = rng.randrange(6)
        key = rng.choice(("prompt", "label", "prompt", "label", "tools", "metadata"))
        if kind <= 1:  # a hostile value
            pairs = [(k, v) for k, v in pairs if k != key] + [(key, value_text(rng))]
        elif kind == 2:  # a key missing
            pairs = [(k, v) for k, v in pairs if k != key]
        elif kind == 3:  # an extra key
            extra = rng.choice(("extra", "Prompt", "label ", "", "\u00e9", "prompt\u0000"))
            pairs.append((extra, value_text(rng)))
        elif kind == 4:  # a key given twice (json keeps the last)
            pairs.append((key, value_text(rng)))
        else:
            rng.shuffle(pairs)
    sep = rng.choice((", ", ",", " ,\t"))
    return "{" + sep.join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"


def jsonl_file(rng: random.Random) -> bytes:
    """A few lines with any line endings and blank lines, then a few byte-level mutations."""
    lines = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.15:
            lines.append(rng.choice(("", "", " ", "\t", "\r", "\u00a0", "\ufeff")))
        lines.append(record_line(rng))
    ends = [rng.choice(("\n",) * 6 + ("\r\n", "\r\n", " \n", "\r")) for _ in lines]
    if rng.random() < 0.3:
        ends[-1] = ""  # no newline at the end of the file
    text = "".join(line + end for line, end in zip(lines, ends, strict=True))
    if rng.random() < 0.05:
        text = "\ufeff" + text  # a byte order mark
    data = bytearray(text.encode("utf-8", "surrogatepass"))
    for _ in range(rng.choice((0, 0, 0, 0, 0, 1, 1, 2, 3))):
        at = rng.randrange(len(data) + 1)
        kind = rng.randrange(5)
        if kind == 0 and data:
            del data[min(at, len(data) - 1)]
        elif kind == 1:
            data[at:at] = rng.choice([bytes([rng.randrange(256)]), b"\n", b'"', b"{", b"\x00"])
        elif kind == 2 and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 3:
            del data[at:]
        else:
            data[at:at] = rng.choice(BAD_UTF8)
    return bytes(data)


def parquet_file(rng: random.Random) -> bytes:
    """A table whose prompt and label columns are of any type (or missing), maybe corrupted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = rng.randint(0, 4)
    columns = {
        "str": lambda: [rng.choice(TEXTS) for _ in range(rows)],
        "nullable": lambda: [rng.choice((None, "a")) for _ in range(rows)],
        "int": lambda: [rng.randrange(-(2**62), 2**62) for _ in range(rows)],
        "float": lambda: [rng.choice((0.5, float("nan"), float("inf"))) for _ in range(rows)],
        "bool": lambda: [rng.random() < 0.5 for _ in range(rows)],
        "list": lambda: [[rng.randrange(9)] for _ in range(rows)],
        "struct": lambda: [{"role": "user", "content": "x"} for _ in range(rows)],
        "null": lambda: [None] * rows,
    }
    table = {}
    for key in ("prompt", "label", "extra"):
        if rng.random() < 0.9:
            table[key] = pa.array(columns[rng.choice(list(columns))]())
    if not table:
        table["other"] = pa.array([1] * rows)
    buffer = io.BytesIO()
    pq.write_table(pa.table(table), buffer)
    data = bytearray(buffer.getvalue())
    for _ in range(rng.choice((0, 0, 1, 2))):
        at = rng.randrange(len(data))
        if rng.random() < 0.3:
            del data[at:]
        else:
            data[at] ^= 1 << rng.randrange(8)
        if not data:
            break
    return bytes(data)


class Hang(BaseException):
    """Not an Exception, so no `except Exception` in a loader can turn it into a UserError."""


def _hang(signum, frame):
    raise Hang(f"a load ran past {HANG} s")


def load(path) -> list:
    return load_prompts(str(path), "prompt", "label", tool_key="tools", metadata_key="metadata")


def outcome(path) -> str:
    """ "read" when the file is read into prompts, "refused" when refused in one line naming
    it; else what went wrong."""
    signal.setitimer(signal.ITIMER_REAL, HANG)
    try:
        prompts = load(path)
    except UserError as exc:
        message = str(exc)
        if len(message.splitlines()) != 1 or str(path) not in message:
            return f"UserError not one line naming the file: {message[:500]!r}"
        return "refused"
    except (Exception, Hang) as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    for p in prompts:
        for name in ("text", "label"):
            value = getattr(p, name)
            if not isinstance(value, str):
                return f"prompt {p.index}: {name} is {type(value).__name__}, not str"
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"prompt {p.index}: {name} is not UTF-8 text ({exc.reason})"
    return "read"


def culprit(path, data: bytes) -> str:
    """The first line that fails on its own in a one-line file (the file itself if none does)."""
    single = path.with_name("culprit" + path.suffix)
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(data.splitlines(keepends=True), start=1):
            single.write_bytes(line)
            if outcome(single) not in OK:
                return f"line {lineno}: {line[:300]!r}" + (
                    f" ... ({len(line)} bytes)" if len(line) > 300 else ""
                )
    return f"the file: {data[:120]!r} ... ({len(data)} bytes)"


def run_cases(tmp_path, suffix: str, make, count: int) -> dict[str, int]:
    failures, counts = [], dict.fromkeys(OK, 0)
    previous = signal.signal(signal.SIGALRM, _hang)
    try:
        for seed in SEEDS:
            rng = random.Random(f"{seed}{suffix}")
            for case in range(count):
                data = make(rng)
                path = tmp_path / f"seed{seed}-case{case}{suffix}"
                path.write_bytes(data)
                result = outcome(path)
                if result in OK:
                    counts[result] += 1
                else:
                    failures.append(f"seed {seed} case {case}: {result}\n  {culprit(path, data)}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if failures:
        shown = "\n".join(failures[:REPORTED])
        pytest.fail(f"{len(failures)} of {len(SEEDS) * count} {suffix} files failed:\n{shown}")
    return counts


def test_fuzzed_jsonl_is_read_or_refused_in_one_line(tmp_path):
    counts = run_cases(tmp_path, ".jsonl", jsonl_file, JSONL_CASES)
    assert min(counts.values()) > 30, counts  # both ends were reached


def test_fuzzed_parquet_is_read_or_refused_in_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    counts = run_cases(tmp_path, ".parquet", parquet_file, PARQUET_CASES)
    assert min(counts.values()) > 0, counts
