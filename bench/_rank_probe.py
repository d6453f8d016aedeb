"""`torchrun ... bench/_rank_probe.py OUT_DIR train FLAGS`: run `mileage train` in this rank and
write OUT_DIR/rank{R}.json at exit: peak RSS, and the seconds of each checkpoint save and of
the resume's restore (bench/distributed.py reads them)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mileage import loop  # noqa: E402
from mileage.checkpoint.writer import CheckpointWriter  # noqa: E402
from mileage.cli.main import main  # noqa: E402

spans: dict[str, list[float]] = {"save_s": [], "restore_s": []}


def timed(function, key: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spans[key].append(time.perf_counter() - start)

    return wrapper


CheckpointWriter.save = timed(CheckpointWriter.save, "save_s")
loop.restore = timed(loop.restore, "restore_s")

out = Path(sys.argv[1])
code = main(sys.argv[2:])
rank = int(os.environ.get("RANK", "0"))
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
(out / f"rank{rank}.json").write_text(json.dumps({"max_rss_kib": peak_kib, **spans}))
sys.exit(code)
