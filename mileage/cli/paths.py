"""Output paths of the `mileage` commands, checked before any work: one line naming the flag,
the path and the OS's reason (exit 2), not a traceback after minutes of work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mileage.errors import UserError


def require_creatable_dir(directory: str | Path, flag: str) -> None:
    """Refuse a `directory` (the value of `flag`) that cannot be created or written in: it, or
    its nearest existing ancestor, must be a directory this process can create files in.
    Leaves nothing behind: the directory is not created, and the file that probes is removed."""
    path = Path(os.path.abspath(directory))
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == path and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory")
    if not existing.is_dir():
        raise UserError(f"cannot create {flag} directory {path}: {existing} is a file")
    try:
        # a real file, since permission bits do not tell: root passes os.access() on /proc
        fd, probe = tempfile.mkstemp(prefix=".mileage-probe-", dir=existing)
    except OSError as exc:
        verb = "write in" if existing == path else "create"
        raise UserError(f"cannot {verb} {flag} directory {path}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)
