"""Dying with the parent process: Linux's PR_SET_PDEATHSIG, for processes that must not outlive
the one that started them (a launched server's supervisor; a torchrun worker, whose launcher
starts it in a session of its own, so a SIGKILL of torchrun would otherwise leave it running,
holding the run's lock until its next collective times out)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals) -> bool:
    """Have the kernel send `sig` to this process when its parent exits.

    Returns False where that is not available (not Linux). A parent that is already gone when
    the signal is armed (this process was re-parented to an init that is not a launcher, or the
    parent changed while arming) gets the signal sent now, so there is no window in which it is
    lost.
    """
    parent = os.getppid()
    armed = False
    with contextlib.suppress(OSError, AttributeError):
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    if armed and ((parent == 1 and not _init_is_a_launcher()) or os.getppid() != parent):
        os.kill(os.getpid(), sig)
    return armed


def _init_is_a_launcher() -> bool:
    """In a container the launcher itself may be PID 1 (`docker run ... torchrun ...`): then a
    parent of 1 is the living launcher, not a sign that the real one died."""
    try:
        command = open("/proc/1/cmdline", "rb").read().replace(b"\0", b" ")  # noqa: SIM115
    except OSError:
        return True  # cannot tell: never kill on a guess
    return b"torch" in command or b"mileage" in command
