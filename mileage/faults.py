"""Named fault-injection points for the crash-anywhere and faulty-disk tests.

`MILEAGE_KILL_AT=<point>[:<hit>]` makes the process SIGKILL itself the <hit>-th time (default
1st) execution reaches `fault_point(<point>)`; under torchrun every rank does, unless
`MILEAGE_KILL_RANK=<r>` names the one rank that dies. `MILEAGE_FAIL_AT=<point>:<ERRNO>[:<hit>]` raises
`OSError(ERRNO)` there instead (ENOSPC, EIO, EACCES...), and `<point>:DELETE` removes the
directory passed to the fault point, as if deleted under the run. Unset, a fault point costs a
string comparison.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal


def _parse(variable: str) -> tuple[str, str, int]:
    point, _, rest = os.environ.get(variable, "").partition(":")
    if variable == "MILEAGE_KILL_AT":
        return point, "", int(rest or 1)
    action, _, hit = rest.partition(":")
    return point, action, int(hit or 1)


_kill_point, _, _kill_hits = _parse("MILEAGE_KILL_AT")
_fail_point, _fail_action, _fail_hits = _parse("MILEAGE_FAIL_AT")
if os.environ.get("MILEAGE_KILL_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _kill_point = ""  # another rank is the one to die


def fault_point(name: str, path: str | os.PathLike | None = None) -> None:
    global _kill_hits, _fail_hits
    if name == _kill_point:
        _kill_hits -= 1
        if _kill_hits == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    if name == _fail_point:
        _fail_hits -= 1
        if _fail_hits == 0:
            if _fail_action == "DELETE":
                shutil.rmtree(path, ignore_errors=True)
                return
            code = getattr(errno, _fail_action)
            raise OSError(code, os.strerror(code), str(path) if path else None)
