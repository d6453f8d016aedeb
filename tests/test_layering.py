"""The layers import downwards only: rollout/ (sampling, scoring, engines) never imports the
trainer, the checkpoint code or the driver above it. Read from the source with `ast`, so an
import inside a function (the lazy kind) counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "mileage"

# package -> the packages and modules it must not import (each with everything below it)
FORBIDDEN = {
    "mileage.rollout": (
        "mileage.training",
        "mileage.checkpoint",
        "mileage.loop",
        "mileage.components",
        "mileage.run_config",
        "mileage.distributed",
        "mileage.cli",
    ),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, at any depth, relative ones
    resolved; `from a import b` counts as both `a` and `a.b` (b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


def violations(root: str, forbidden: tuple[str, ...]) -> list[str]:
    folder = PACKAGE.joinpath(*root.split(".")[1:])
    found = []
    for path in sorted(folder.rglob("*.py")):
        name = module_name(path)
        imports = imported_modules(path.read_text(), name, path.name == "__init__.py")
        for imported in sorted(imports):
            if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(REPO)} imports {imported}")
    return found


@pytest.mark.parametrize("root", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(root):
    assert violations(root, FORBIDDEN[root]) == []


def test_the_import_reader_sees_lazy_relative_and_from_imports():
    """The check above would pass vacuously if the reader missed imports."""
    source = (
        "import mileage.loop\n"
        "from mileage.training import actor\n"
        "from ..checkpoint.plan import plan_start\n"
        "from . import sibling\n"
        "def later():\n"
        "    from mileage.components import Run\n"
    )
    found = imported_modules(source, "mileage.rollout.engines.x")
    assert {
        "mileage.loop",
        "mileage.training.actor",
        "mileage.rollout.checkpoint.plan",
        "mileage.rollout.engines.sibling",
        "mileage.components.Run",
    } <= found
