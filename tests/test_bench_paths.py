"""The benchmarks' `--out`: any path works, `.json` is added only when missing, and a bad path
is refused in one line before any measuring starts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mileage.errors import UserError

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def _load_common():
    spec = importlib.util.spec_from_file_location("bench_common_under_test", BENCH / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load_common()


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("rl_step", "rl_step.json"),
        ("x.json", "x.json"),
        ("x.JSON", "x.JSON"),
        ("run.v2", "run.v2.json"),
    ],
)
def test_a_bare_name_lands_in_bench_results(out, expected):
    assert common.results_path(out) == common.RESULTS / expected


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("../x.json", "x.json"),  # the case: not x.json.json, and no traceback
        ("../x", "x.json"),
        ("./sub/y.v2", "work/sub/y.v2.json"),
        ("sub/z.json", "work/sub/z.json"),
        ("./w", "work/w.json"),
    ],
)
def test_a_path_is_taken_from_the_working_directory(out, expected, tmp_path, monkeypatch):
    (tmp_path / "work" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    path = common.results_path(out)
    assert path.resolve() == (tmp_path / expected).resolve()
    assert common.checked_results_path(out).resolve() == path.resolve()


def test_absolute_and_home_paths(tmp_path, monkeypatch):
    assert common.results_path(str(tmp_path / "a.json")) == tmp_path / "a.json"
    assert common.results_path(str(tmp_path / "a")) == tmp_path / "a.json"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert common.results_path("~/b") == tmp_path / "b.json"


@pytest.mark.parametrize("out", ["", "  ", "dir/", ".", "..", "/"])
def test_a_name_that_is_no_file_is_refused(out):
    with pytest.raises(UserError, match="--out"):
        common.results_path(out)


def test_unwritable_places_are_refused_before_measuring(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        common.checked_results_path("missing/x.json")
    (tmp_path / "plain").write_text("")
    with pytest.raises(UserError, match="is not a directory"):
        common.checked_results_path("plain/x.json")
    (tmp_path / "taken.json").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        common.checked_results_path("./taken")
    # the write probe left nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "taken.json"]


def test_results_are_written_outside_the_repository(tmp_path, capsys):
    path = common.checked_results_path(str(tmp_path / "x.json"))
    assert common.write_results(path, {"rows": [1]}) == path
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    assert capsys.readouterr().out == f"wrote {path}\n"


@pytest.mark.parametrize(
    "script", ["rl_step", "generation", "resume", "checkpoint", "async", "optimizer"]
)
def test_each_benchmark_refuses_a_bad_out_at_once(script, tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "x.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), "--out", str(missing)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""  # nothing measured, not even the machine line
    assert proc.stderr.splitlines() == [
        f"{script}.py: error: --out {missing}: the directory {missing.parent} does not exist"
    ]
