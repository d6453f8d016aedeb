"""`python -m mileage` is the `mileage` command."""

import os
import signal
import sys

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # a torchrun worker: armed before the heavy imports, so that a launcher killed while the
    # workers start up does not leave them waiting for a rendezvous that never comes
    from mileage.parent_death import die_with_parent

    die_with_parent(signal.SIGKILL)

from mileage.cli.main import run  # noqa: E402

sys.exit(run())
