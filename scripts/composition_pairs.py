"""Check that the composition matrix in docs/composition.md is an all-pairs covering array.

Factors (issue 33): driver {sync, one-step-off, fully async} x source {plain, dynamic sampling,
partial rollout, multi-turn tools, user rollout function} x weights {full, LoRA} x engine {local,
mileage serve} x world size {1, 2} x algorithm {GRPO, critic PPO}. Every pair of values of two
factors must be run by some row of the table with at least two kills (the numbers before "named"
and "at random" in its kills column), or be refused for a physical reason quoted in the doc's
"Refused combinations" section. Prints each pair with the first row that runs
it; exits 1 naming the pairs no row runs.

    python scripts/composition_pairs.py [docs/composition.md]
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "composition.md"

FACTORS: dict[str, list[str]] = {
    "driver": ["sync", "one-step-off", "fully async"],
    "source": ["plain", "dynamic sampling", "partial rollout", "multi-turn tools", "rollout fn"],
    "weights": ["full", "LoRA"],
    "engine": ["local", "serve"],
    "N": ["1", "2"],
    "algorithm": ["GRPO", "critic PPO"],
}
# pairs refused for a physical reason, with the words of the refusal the doc must quote
REFUSED: dict[tuple[str, str], str] = {}  # none now: every pair is run by a row
_DRIVERS = {"train": "sync", "async one-step-off": "one-step-off", "async fully": "fully async"}
_SOURCES = {
    "plain": "plain",
    "dynamic sampling": "dynamic sampling",
    "partial rollout": "partial rollout",
    "multi-turn tools": "multi-turn tools",
    "rollout function": "rollout fn",
}


MIN_KILLS = 2


def kills(cell: str) -> int:
    """The kills a row's kills column counts: "3 named: ...", "4 at random instants ..."."""
    return sum(int(n) for n in re.findall(r"(\d+) (?:named|at random)", cell))


def drivers(cell: str) -> set[str]:
    """The drivers a row runs: "train", or several for a parametrized row ("async one-step-off;
    async fully (parametrized)")."""
    names = (name.strip() for name in re.sub(r"\(.*?\)", "", cell).split(";"))
    return {_DRIVERS[name] for name in names if name in _DRIVERS}


def rows(text: str) -> list[tuple[str, dict[str, set[str]]]]:
    """(row number, {factor: values}) for each row of the killed-runs table with at least
    MIN_KILLS kills."""
    out = []
    for line in text.splitlines():
        if not re.match(r"\| \d+ \|", line):
            continue
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        number, driver, source, weights, engine, n, algorithm = cells[:7]
        if kills(cells[8]) < MIN_KILLS:
            continue
        values = {
            "driver": drivers(driver),
            "source": {name for key, name in _SOURCES.items() if key in source},
            "weights": {"LoRA" if "LoRA" in weights else "full"},
            "engine": {"serve"} if "serve" in engine else ({"local"} if "in-proc" in engine else set()),
            "N": {n},
            "algorithm": {"critic PPO"} if "critic PPO" in algorithm else (
                {"GRPO"} if "GRPO" in algorithm or "GSPO" in algorithm else set()
            ),
        }  # fmt: skip
        out.append((number, values))
    return out


def coverage(text: str) -> tuple[list[str], list[str]]:
    """(report lines, uncovered pairs)."""
    table = rows(text)
    refused_section = text.split("## Refused combinations", 1)[-1]
    report, missing = [], []
    for f1, f2 in itertools.combinations(FACTORS, 2):
        for v1, v2 in itertools.product(FACTORS[f1], FACTORS[f2]):
            label = f"{f1}={v1} x {f2}={v2}"
            hits = [n for n, values in table if v1 in values[f1] and v2 in values[f2]]
            reason = REFUSED.get((v1, v2)) or REFUSED.get((v2, v1))
            if hits:
                report.append(f"{label}: row {hits[0]} ({len(hits)} rows)")
            elif reason and reason in refused_section:
                report.append(f"{label}: refused ({reason})")
            else:
                missing.append(label)
    return report, missing


def main(argv: list[str]) -> int:
    doc = Path(argv[0]) if argv else DOC
    report, missing = coverage(doc.read_text())
    print("\n".join(report))
    print(f"{len(report)} pairs run or refused; {len(missing)} run by no row")
    for label in missing:
        print(f"not run: {label}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
