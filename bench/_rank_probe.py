"""`torchrun ... bench/_rank_probe.py OUT_DIR train FLAGS`: run `mileage train` in this rank and
write OUT_DIR/rank{R}.json at exit: peak RSS, the seconds of each checkpoint save and of the
resume's restore, and where the peak was reached (bench/distributed.py reads them).

Where: after each phase of the run (building the run, loading and sharding the models,
generating, training, syncing the engine, saving) the probe records the process's resident set
(VmRSS) and its high-water mark so far (VmHWM, the peak `ru_maxrss` reports). The first phase
after which the high-water mark reaches its final value is the one the peak happened in."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mileage import build, loop  # noqa: E402
from mileage.checkpoint.writer import CheckpointWriter  # noqa: E402
from mileage.cli import train as train_cli  # noqa: E402
from mileage.cli.main import main  # noqa: E402
from mileage.distributed import setup  # noqa: E402
from mileage.distributed.checkpoint import ShardedCheckpointWriter  # noqa: E402
from mileage.sources import on_policy  # noqa: E402
from mileage.sources.on_policy import OnPolicySource  # noqa: E402
from mileage.training.actor import Actor  # noqa: E402

spans: dict[str, list[float]] = {"save_s": [], "restore_s": []}
phases: list[dict] = []


def memory_kib() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in KiB (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM") if key in fields}


def timed(function, key: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spans[key].append(time.perf_counter() - start)

    return wrapper


def phase(function, name: str):
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            phases.append({"phase": name, **memory_kib()})

    return wrapper


CheckpointWriter.save = phase(timed(CheckpointWriter.save, "save_s"), "save")
# under torchrun (its own save, not calling the one above)
ShardedCheckpointWriter.save = phase(timed(ShardedCheckpointWriter.save, "save_s"), "save")
loop.restore = timed(loop.restore, "restore_s")
setup.shard_run_models = phase(setup.shard_run_models, "load+shard")
build._load = phase(build._load, "load")
train_cli.build_run = phase(train_cli.build_run, "build")
OnPolicySource.draw = phase(OnPolicySource.draw, "generate")
Actor.train_rollout = phase(Actor.train_rollout, "train")
loop.sync_engine = phase(loop.sync_engine, "sync")  # the start's
on_policy.sync_engine = phase(on_policy.sync_engine, "sync")  # each rollout's

out = Path(sys.argv[1])
code = main(sys.argv[2:])
rank = int(os.environ.get("RANK", "0"))
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = {"max_rss_kib": peak_kib, "phases": phases, **spans}
(out / f"rank{rank}.json").write_text(json.dumps(result))
sys.exit(code)
