"""User functions named on the command line, loaded from exactly the path the user names.

Three spellings: `module.path:fn`, `module.path.fn` (imported by name from sys.path), and
`path/to/file.py:fn` (that file, and only it, is executed as a module; nothing else on disk is
searched). Every user function the run takes goes through `load_function`, so they all fail
alike: one line naming the flag, exit 2, before anything is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mileage.config import option
from mileage.errors import UserError

T = TypeVar("T")


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


# ---------------------------------------------------------------------------------------------
# The boundary every call of a user function goes through at run time (`HookCalls.run`).
#
# The contracts, in one place (what each function is called with, what it must return; the
# return is checked where the value is used, and a refusal names the function, its flag, the
# sample and what was expected):
#
#   --custom-rm-path                 a finite real number (bool counts as 0/1) with |r| <= 1e6,
#                                    one per sample (--group-rm: a list of them per group)
#   --custom-generate-function-path  a Sample (or a list of one) of the prompt it was given, its
#                                    per-token lists aligned, its ids inside the vocabulary;
#                                    `response` is decoded from the ids when left empty
#   --dynamic-sampling-filter-path   a bool, (bool, reason) or an object with a bool `.keep`
#   --buffer-filter-path             at most n of the buffer's groups, removed from it
#   --rollout-function-path          --rollout-batch-size x --n-samples-per-prompt Samples
#   --custom-loss-function-path      (loss tensor, dict of metrics)
#
# Each call runs in a worker thread that the caller's thread watches: a call that raises
# anything (SystemExit included: a hook's sys.exit(0) must not end the run as a success) or that
# runs past --hook-timeout seconds of its own stops the run with one line naming the function,
# its flag and the call (exit 2), before the rollout is saved. The user's traceback is printed
# above that line: it is their code. A thread cannot be killed: a timed-out call is left running
# (a daemon thread) and the process exits. The custom loss is the exception to the thread: it
# runs inside the training step, whose grad mode and autocast are per-thread state, so it keeps
# the training thread (raising is still named; no timeout).
# ---------------------------------------------------------------------------------------------

DEFAULT_HOOK_TIMEOUT = 600.0
HOOK_TIMEOUT_FLAG = "--hook-timeout"


@dataclass
class HookConfig:
    hook_timeout: float = option(
        DEFAULT_HOOK_TIMEOUT,
        "seconds one call of a user function (--custom-rm-path, --custom-generate-function-path, "
        "--dynamic-sampling-filter-path, --buffer-filter-path, --rollout-function-path) may run; "
        "a generate or rollout function's waits on the run's own sampling and tool calls do not "
        "count. Past it the run stops (exit 2) before the rollout is saved",
    )

    def validate(self) -> None:
        if not 0 < self.hook_timeout <= threading.TIMEOUT_MAX:
            raise UserError(
                f"{HOOK_TIMEOUT_FLAG} must be positive and at most {threading.TIMEOUT_MAX:g} "
                f"seconds (the longest wait Python can make), got {self.hook_timeout:g}"
            )


@dataclass(frozen=True)
class Hook:
    """A user function as the run names it when it fails."""

    name: str  # "reward function"
    flag: str  # the flag that named it
    timeout: float = DEFAULT_HOOK_TIMEOUT


class Clock:
    """How long one call has run on its own: wall time since it started, less the time it spent
    waiting on the run itself (sampling, tool calls), which the run bounds on its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: float | None = None
        self.finished = False
        self._away = 0.0
        self._away_since: float | None = None
        self._depth = 0

    def start(self) -> None:
        with self._lock:
            self.started = time.monotonic()

    def finish(self) -> None:
        with self._lock:
            self.finished = True

    def own(self, now: float) -> float:
        """Seconds of its own the call has run by `now` (0 before it starts, after it ends)."""
        with self._lock:
            if self.started is None or self.finished:
                return 0.0
            away = self._away + (now - self._away_since if self._away_since is not None else 0)
            return now - self.started - away

    @contextlib.contextmanager
    def waiting_on_the_run(self) -> Iterator[None]:
        """Time inside this block is the run's (an engine batch, a tool call), not the hook's."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._away_since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._away_since is not None:
                    self._away += time.monotonic() - self._away_since
                    self._away_since = None


class _Raised(Exception):
    """A call of user code raised `error` (anything, SystemExit included)."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(index)
        self.index = index
        self.error = error


class HookCalls:
    """Calls of one user function, one per label ("sample 3", "the group of prompt 7"), made by
    `body` in a worker thread that `run` watches (module comment above)."""

    def __init__(self, hook: Hook, labels: list[str]):
        self.hook = hook
        self.labels = labels
        self.clocks = [Clock() for _ in labels]

    def call(self, index: int, fn: Callable, *args: Any) -> Any:
        """fn(*args) as call `index` (in the worker thread)."""
        clock = self.clocks[index]
        clock.start()
        try:
            return fn(*args)
        except UserError:
            raise  # the run's own refusal (of something the function passed it), already named
        except BaseException as exc:  # noqa: BLE001 - whatever user code raises is named
            raise _Raised(index, exc) from None
        finally:
            clock.finish()

    async def acall(self, index: int, awaitable: Awaitable) -> Any:
        """`await awaitable` as call `index` (on the worker thread's event loop)."""
        clock = self.clocks[index]
        clock.start()
        try:
            return await awaitable
        except (UserError, asyncio.CancelledError):
            raise  # the run's own refusal, or the run cancelling the call (another one failed)
        except BaseException as exc:  # noqa: BLE001 - whatever user code raises is named
            raise _Raised(index, exc) from None
        finally:
            clock.finish()

    def run(self, body: Callable[[HookCalls], T]) -> T:
        """body(self) in a worker thread; its result, or the run stopped in one line."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["result"] = body(self)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=work, name=f"mileage {self.hook.flag}", daemon=True)
        thread.start()
        poll = min(0.1, self.hook.timeout / 4)
        while thread.is_alive():
            thread.join(poll)
            if thread.is_alive():
                self._check_time(thread)
        error = box.get("error")
        if isinstance(error, _Raised):
            raise hook_failed(self.hook, self.labels[error.index], error.error) from None
        if error is not None:
            raise error
        return box["result"]

    def _check_time(self, thread: threading.Thread) -> None:
        now = time.monotonic()
        over = [i for i, c in enumerate(self.clocks) if c.own(now) > self.hook.timeout]
        if not over:
            return
        running, where = _running_call(thread)
        index = running if running in over else over[0]
        hook = self.hook
        at = f" (it was at {where})" if where else ""
        raise UserError(
            f"{hook.flag}: the {hook.name} ran past {HOOK_TIMEOUT_FLAG} {hook.timeout:g}s on "
            f"{self.labels[index]}{at}; the run stopped before saving this rollout: make it "
            f"return sooner or raise {HOOK_TIMEOUT_FLAG}"
        )


def hook_failed(hook: Hook, label: str, error: BaseException) -> UserError:
    """The one line a run stops with when a call of user code raised `error` (printed above it
    with the user's traceback: it is their code)."""
    if isinstance(error, SystemExit):
        what = f"called sys.exit({error.code!r})"
    else:
        what = f"raised {type(error).__name__}: {error}"
    tb = error.__traceback__  # without the boundary's own frame on top
    if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    print("".join(traceback.format_exception(type(error), error, tb)), end="", file=sys.stderr)
    return UserError(
        f"{hook.flag}: the {hook.name} {what} on {label} (traceback above); the run stopped "
        "before saving this rollout: fix the function and run the same command again"
    )


def _running_call(thread: threading.Thread) -> tuple[int | None, str | None]:
    """(index of the call the worker thread is inside now, the innermost line of user code it
    is at), as far as its stack tells: a call blocked in user code names itself."""
    frame = sys._current_frames().get(thread.ident or -1)
    where = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename == __file__ and code.co_name in ("call", "acall"):
            return frame.f_locals.get("index"), where
        if where is None and _is_user_code(code.co_filename):
            where = f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None, where


def _is_user_code(filename: str) -> bool:
    package = str(Path(__file__).resolve().parents[1])
    stdlib = sysconfig.get_paths()["stdlib"]
    return not (filename.startswith((package, stdlib)) or filename.startswith("<"))


def run_hook(hook: Hook, label: str, fn: Callable, *args: Any) -> Any:
    """One call of a user function through the boundary (a sync function, or an async one
    awaited on an event loop of its own)."""
    calls = HookCalls(hook, [label])

    def body(c: HookCalls) -> Any:
        if inspect.iscoroutinefunction(fn):
            return asyncio.run(c.acall(0, fn(*args)))
        result = c.call(0, fn, *args)
        if inspect.isawaitable(result):
            return asyncio.run(c.acall(0, result))
        return result

    return calls.run(body)


class BoundedHook:
    """A user function whose every call goes through the boundary (`run_hook`)."""

    def __init__(self, fn: Callable, hook: Hook):
        self.fn = fn
        self.hook = hook

    def call(self, label: str, *args: Any) -> Any:
        return run_hook(self.hook, label, self.fn, *args)

    def __call__(self, *args: Any) -> Any:
        return run_hook(self.hook, "one call", self.fn, *args)


def named_in_thread(
    fn: Callable, hook: Hook, problem: Callable[[Any], str | None] | None = None
) -> Callable:
    """`fn` called in the caller's own thread (the custom loss: module comment above), what it
    raises named as the boundary names it, and what it returns refused when `problem` says why."""

    def named(*args: Any) -> Any:
        try:
            out = fn(*args)
        except (UserError, KeyboardInterrupt):
            raise  # the run's own refusal; Ctrl-C interrupts the run as anywhere else
        except BaseException as exc:  # noqa: BLE001 - whatever user code raises is named
            raise hook_failed(hook, "one call", exc) from None
        why = problem(out) if problem else None
        if why:
            raise UserError(f"{hook.flag}: the {hook.name} returned {why}")
        return out

    return named


def loss_problem(out: Any) -> str | None:
    """Why a custom loss's return is not (loss tensor, dict of metrics)."""
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and callable(getattr(out[0], "backward", None))
        and isinstance(out[1], dict)
    ):
        return None
    return f"{type(out).__name__}; expected (loss tensor, dict of metrics)"
