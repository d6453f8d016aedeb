"""Every benchmark in bench/ and script in scripts/ runs its `main` when started as a script: a refactor that drops the
`if __name__ == "__main__"` line leaves a command the docs print that exits 0 having measured
nothing (bench/train_pass.py did, from be77fa4 on). Reads the sources only."""

from __future__ import annotations

import ast

from conftest import REPO


def runs_main(tree: ast.Module) -> bool:
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test) == "__name__ == '__main__'"
        ):
            return "main(" in ast.unparse(node)
    return False


def test_every_benchmark_and_script_runs_its_main():
    scripts = sorted(
        p
        for folder in ("bench", "scripts")
        for p in (REPO / folder).glob("*.py")
        if not p.name.startswith("_")
    )
    assert len(scripts) > 20
    silent = [p.name for p in scripts if not runs_main(ast.parse(p.read_text(encoding="utf-8")))]
    assert silent == [], f"started as scripts, these do nothing: {silent}"
