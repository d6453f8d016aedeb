"""Named fault-injection points for the crash-anywhere, faulty-disk and preemption tests.

`MILEAGE_KILL_AT=<point>[:<hit>]` makes the process SIGKILL itself the <hit>-th time (default
1st) execution reaches `fault_point(<point>)`; under torchrun every rank does, unless
`MILEAGE_KILL_RANK=<r>` names the one rank that dies. `MILEAGE_FAIL_AT=<point>:<ERRNO>[:<hit>]`
raises `OSError(ERRNO)` there instead (ENOSPC, EIO, EACCES...), and `<point>:DELETE` removes the
directory passed to the fault point, as if deleted under the run; `<point>:NAN` makes
`poison_point(<point>, tensors)` write a NaN into the first of its tensors (the non-finite
checks' tests: a NaN in a gradient or a weight at a known step).
`MILEAGE_SIGNAL_AT=<point>:<SIGNAME>[:<hit>]` sends the process that signal there, so that a
SIGTERM lands at a known place (e.g. a second one inside a save). Each variable may hold several
comma-separated specs. Unset, a fault point costs a loop over an empty list.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from dataclasses import dataclass


@dataclass
class _Spec:
    variable: str
    point: str
    action: str  # "" (kill), an errno name or DELETE (fail), a signal name (signal)
    hits_left: int


def _parse() -> list[_Spec]:
    specs = []
    rank = os.environ.get("RANK", "0")
    for variable in ("MILEAGE_KILL_AT", "MILEAGE_FAIL_AT", "MILEAGE_SIGNAL_AT"):
        for spec in filter(None, os.environ.get(variable, "").split(",")):
            point, _, rest = spec.partition(":")
            if variable == "MILEAGE_KILL_AT":
                if os.environ.get("MILEAGE_KILL_RANK", rank) != rank:
                    continue  # another rank is the one to die
                action, hit = "", rest
            else:
                action, _, hit = rest.partition(":")
            specs.append(_Spec(variable, point, action, int(hit or 1)))
    return specs


_specs = _parse()


def fault_point(name: str, path: str | os.PathLike | None = None) -> None:
    for spec in _specs:
        if spec.point != name:
            continue
        spec.hits_left -= 1
        if spec.hits_left != 0:
            continue
        if spec.variable == "MILEAGE_KILL_AT":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.variable == "MILEAGE_SIGNAL_AT":
            os.kill(os.getpid(), getattr(signal, spec.action))
        elif spec.action == "DELETE":
            shutil.rmtree(path, ignore_errors=True)
        else:
            code = getattr(errno, spec.action)
            raise OSError(code, os.strerror(code), str(path) if path else None)


def poison_point(name: str, tensors: list) -> None:
    """A `MILEAGE_FAIL_AT=<name>:NAN` point: the first non-None tensor gets a NaN (in place)."""
    for spec in _specs:
        if spec.point != name or spec.action != "NAN":
            continue
        spec.hits_left -= 1
        if spec.hits_left == 0:
            target = next(t for t in tensors if t is not None).detach()
            if hasattr(target, "to_local"):  # an FSDP shard: this rank's part
                target = target.to_local()
            target.view(-1)[0] = float("nan")
