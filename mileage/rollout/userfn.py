"""User functions named on the command line, loaded from exactly the path the user names.

Three spellings: `module.path:fn`, `module.path.fn` (imported by name from sys.path), and
`path/to/file.py:fn` (that file, and only it, is executed as a module; nothing else on disk is
searched). Every user function the run takes goes through `load_function`, so they all fail
alike: one line naming the flag, exit 2, before anything is written.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from mileage.errors import UserError


def _import_file(path: Path, flag: str):
    """Execute the file at `path` as a module (cached under a name derived from its path, so
    the tool worker processes and the trainer load it under the same name)."""
    resolved = path.resolve()
    if not resolved.is_file():
        raise UserError(f"{flag}: {path} is not a file")
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"mileage_user_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UserError(f"{flag}: cannot import {path} (not a Python file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure is the user's module
        del sys.modules[name]
        raise UserError(f"{flag}: cannot import {path}: {type(exc).__name__}: {exc}") from None
    return module


def load_function(path: str, flag: str) -> Callable:
    """The callable `path` names (module.path:fn, module.path.fn or path/to/file.py:fn)."""
    if ":" in path:
        module_name, sep, attr = path.rpartition(":")
    else:
        module_name, sep, attr = path.rpartition(".")
    if not sep or not module_name or not attr:
        raise UserError(
            f"{flag} must look like module.path:function or path/to/file.py:function, got {path!r}"
        )
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name), flag)
    else:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
            raise UserError(f"{flag}: cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{flag}: {module_name!r} has no function {attr!r}")
    return fn


def positional_arity(fn: Callable) -> tuple[int, int] | None:
    """(required, maximum) positional parameters of `fn` (maximum -1: *args); None when Python
    cannot tell (some builtins), which callers accept."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    required = maximum = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            maximum = -1
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            maximum = maximum if maximum < 0 else maximum + 1
            required += p.default is p.empty
        elif p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            return (required, -2)  # a required keyword-only argument: no positional call works
    return (required, maximum)


def accepts(fn: Callable, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments."""
    arity = positional_arity(fn)
    if arity is None:
        return True
    required, maximum = arity
    if maximum == -2:
        return False
    return required <= count and (maximum < 0 or count <= maximum)


def require_signature(
    fn: Callable, flag: str, count: int, shape: str, coroutine: bool | None = None
) -> None:
    """Refuse (one line, exit 2) a user function that cannot be called as `shape` with `count`
    positional arguments, or that is not `async def` when `coroutine` asks for one."""
    name = getattr(fn, "__qualname__", repr(fn))
    if not accepts(fn, count):
        raise UserError(f"{flag}: {name} must be callable as {shape}")
    if coroutine and not inspect.iscoroutinefunction(fn):
        raise UserError(f"{flag}: {name} must be an async function: async def {shape}")
