"""DEVELOPERS.md's layout map names every module of mileage/, and names nothing that is gone.

The map is the first fenced block under "## Layout": a path indented two spaces per folder
level under the folder lines (`rollout/`, `engines/`) above it, or written with its folder
(`testing/crash.py`), then its description from a fixed column; continuation lines are indented
to that column. Reads files only."""

from __future__ import annotations

import re

from conftest import REPO

PACKAGE = REPO / "mileage"
DEVELOPERS = REPO / "DEVELOPERS.md"


def map_block() -> list[str]:
    text = DEVELOPERS.read_text(encoding="utf-8")
    section = text.split("\n## Layout", 1)[1]
    block = section.split("```", 2)[1]
    lines = block.splitlines()[1:]  # the fence's own line ends right after "```"
    assert lines and lines[0] == "mileage/", "the layout map starts with `mileage/`"
    return lines[1:]


def named_paths() -> set[str]:
    """Paths relative to mileage/ that the map names (folders with a trailing slash)."""
    paths: set[str] = set()
    folders: list[str] = []  # the folder lines above, one per indentation level
    for line in map_block():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent >= 20:  # a description's continuation line
            continue
        assert indent % 2 == 0 and indent >= 2, f"odd indentation in the layout map: {line!r}"
        depth = indent // 2 - 1
        assert depth <= len(folders), f"indented deeper than its folder: {line!r}"
        del folders[depth:]
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for name in names.split(", "):  # "a.py, b.py": two modules on one line
            path = "".join(folders) + name
            paths.add(path)
            if name.endswith("/"):
                folders.append(name)
    return paths


def modules() -> set[str]:
    return {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }


def test_every_module_is_in_the_layout_map():
    missing = sorted(modules() - named_paths())
    assert not missing, (
        "modules missing from DEVELOPERS.md's layout map (add one line each, in its folder's "
        "block): " + ", ".join(missing)
    )


def test_the_layout_map_names_only_what_exists():
    gone = sorted(path for path in named_paths() if not (PACKAGE / path).exists())
    assert not gone, "DEVELOPERS.md's layout map names paths that do not exist: " + ", ".join(gone)
