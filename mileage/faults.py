"""Named fault-injection points for the crash-anywhere tests.

`MILEAGE_KILL_AT=<point>[:<hit>]` makes the process SIGKILL itself the <hit>-th time (default
1st) execution reaches `fault_point(<point>)`. Unset, a fault point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

_target = os.environ.get("MILEAGE_KILL_AT", "")
_point, _, _hit = _target.partition(":")
_remaining = int(_hit or 1)


def fault_point(name: str) -> None:
    global _remaining
    if name != _point:
        return
    _remaining -= 1
    if _remaining == 0:
        os.kill(os.getpid(), signal.SIGKILL)
