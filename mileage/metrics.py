"""Per-rollout metrics: one JSON object per line in RUN_DIR/metrics.jsonl, then the trackers.

On resume the log is cut back to the rollouts the checkpoint covers, so a run that was killed
and restarted ends with exactly one record per rollout, like an uninterrupted run. The trackers
(TensorBoard, W&B: `mileage/tracking.py`) get every record after it is durable in the log.

The evaluation before training is the record with rollout_id -1 (`EVAL_BEFORE_TRAINING`): like
the `eval_accuracy` of rollout N, which is measured after N's training, it describes the weights
after "rollout -1", the ones training starts from. It is the first line of the log; a resume
keeps it, and only a start at rollout 0, which evaluates again, replaces it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mileage.errors import UserError

METRICS_FILE = "metrics.jsonl"
# the rollout_id of the record of the evaluation before training
EVAL_BEFORE_TRAINING = -1
# keys measured on the machine, not computed: wall-clock times and memory peaks (identical
# runs differ in them; a resumed run is compared without them)
TIMING_KEYS = frozenset(
    {
        "time",
        "step_time",
        "gen_time",
        "train_time",
        "sync_time",
        "tokens_per_s",
        "mem_peak_gib",
        "mem_cuda_peak_gib",
    }
)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl ([] if absent); one line naming a corrupt record.

    A last line without its newline was being written when the process was killed: the rollout
    it describes is not checkpointed (the log is written before the save), so it is dropped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is unreadable ({exc})") from None
    lines = text.split("\n")
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if lineno == len(lines):
                break  # torn by a kill mid-write
            raise UserError(f"{path}:{lineno}: not valid JSON ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("rollout_id"), int):
            raise UserError(f"{path}:{lineno}: not a mileage metrics record (no rollout_id)")
        records.append(record)
    return records


def rollout_records(records: list[dict]) -> list[dict]:
    """The records of trained rollouts: all but the evaluation before training."""
    return [r for r in records if r["rollout_id"] != EVAL_BEFORE_TRAINING]


class MetricsLog:
    def __init__(self, run_dir: str | Path | None, trackers: list | None = None):
        self.path = Path(run_dir) / METRICS_FILE if run_dir else None
        self.trackers = trackers or []

    def truncate_from(self, rollout_id: int) -> None:
        """Drop records of rollouts >= `rollout_id` (they will be produced again).

        A start at rollout 0 drops the evaluation before training too: it evaluates again (or,
        with --skip-eval-before-train, must not inherit another process's evaluation). The
        trackers then get the chance to catch up on the records kept (see tracking.py).
        """
        if rollout_id <= 0:
            rollout_id = EVAL_BEFORE_TRAINING
        if self.path is None or not self.path.is_file():
            kept = []
        else:
            kept = [r for r in read_metrics(self.path.parent) if r["rollout_id"] < rollout_id]
            temp = self.path.with_suffix(".tmp")
            temp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
            os.replace(temp, self.path)
        for tracker in self.trackers:
            tracker.catch_up(kept)

    def log(self, record: dict) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
