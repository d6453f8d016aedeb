"""`scripts/mutate.py` plants each mutant by replacing one snippet of the source: a snippet that
moved with a refactor would leave its mutant unplantable, and the bug it stands for unguarded,
without anyone noticing until the next mutation run. Read, not run: no training here."""

from __future__ import annotations

import importlib.util
import sys

from conftest import REPO


def load_mutate():
    spec = importlib.util.spec_from_file_location("mutate_script", REPO / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate_script"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_mutant_snippet_occurs_once_and_its_tests_exist():
    mutants = load_mutate().MUTANTS
    problems = []
    for mutant in mutants:
        path = REPO / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: {mutant.file} does not exist")
            continue
        count = path.read_text().count(mutant.find)
        if count != 1:
            problems.append(f"{mutant.name}: its snippet occurs {count} times in {mutant.file}")
        for test in mutant.tests:
            if not (REPO / test.split("::")[0]).is_file():
                problems.append(f"{mutant.name}: its test file {test} does not exist")
    assert len(mutants) > 100
    assert problems == []
