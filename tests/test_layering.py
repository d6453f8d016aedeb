"""The layers import downwards only. Every module of mileage belongs to one layer (its folder,
or for a top-level module its own name), and may import its own layer and those below it,
never one above. Read from the source with `ast`, so an import inside a function (the lazy
kind) counts as much as one at the top. A new folder or module with no layer fails the check
until it is given one."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "mileage"

# bottom to top; a unit is a folder of mileage/ or a top-level module ("" is mileage/__init__)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        ("", "errors", "config", "seeding", "faults", "parent_death", "allocator", "ranks",
         "preemption", "metrics", "tracking"),
    ),
    ("models", ("models", "precision")),
    # generation and scoring; the built-in tasks and the warm-up of their model
    ("rollout", ("rollout", "progress")),
    # checkpoints record the built-in task a model came from (and rebuild it)
    ("checkpoint", ("checkpoint",)),
    ("training", ("training",)),
    ("distributed", ("distributed",)),
    (
        "drivers",
        ("run_config", "cross_checks", "async_config", "preflight", "build", "components", "sources", "loop", "plot",
         "serve"),
    ),
    ("cli", ("cli", "__main__", "testing")),
)  # fmt: skip
LEVEL = {unit: level for level, (_, units) in enumerate(LAYERS) for unit in units}


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


def unit_of(module: str) -> str:
    """`mileage.rollout.engine.X` -> "rollout"; `mileage` -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def source_modules() -> list[tuple[Path, str]]:
    return [(path, module_name(path)) for path in sorted(PACKAGE.rglob("*.py"))]


def upward_imports(module: str, imports: set[str]) -> list[str]:
    """The imports of `module` that reach a layer above its own."""
    own = LEVEL[unit_of(module)]
    found = []
    for imported in sorted(imports):
        if imported != "mileage" and not imported.startswith("mileage."):
            continue
        level = LEVEL.get(unit_of(imported))
        if level is not None and level > own:
            found.append(f"{module} ({LAYERS[own][0]}) imports {imported} ({LAYERS[level][0]})")
    return found


def test_every_module_has_a_layer():
    missing = sorted({unit_of(name) for _, name in source_modules()} - set(LEVEL))
    assert missing == [], f"give these a layer in LAYERS: {missing}"


def test_no_module_imports_a_layer_above_its_own():
    found = []
    for path, name in source_modules():
        imports = imported_modules(path.read_text(), name, path.name == "__init__.py")
        found += upward_imports(name, imports)
    assert found == []


def test_the_layer_check_refuses_an_upward_import():
    """The check above would pass vacuously if it never flagged anything."""
    source = "def warm_up():\n    from mileage.rollout.engine import LocalEngine\n"
    imports = imported_modules(source, "mileage.models.tiny")
    assert upward_imports("mileage.models.tiny", imports) == [
        "mileage.models.tiny (models) imports mileage.rollout.engine (rollout)",
        "mileage.models.tiny (models) imports mileage.rollout.engine.LocalEngine (rollout)",
    ]
    assert upward_imports("mileage.rollout.tasks", {"mileage.models.tiny"}) == []


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
