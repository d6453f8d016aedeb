"""Experiment trackers beside metrics.jsonl: TensorBoard and Weights & Biases (miles' flags).

metrics.jsonl is the record of a run: on resume it is cut back to the checkpoint and the lost
rollouts are produced again, bit for bit. A tracker cannot un-log, so W&B is made to agree with
it another way: every record is logged at `step=rollout_id + 1` (`wandb_step`: step 0 is the
evaluation before training, whose rollout_id is -1, and W&B steps cannot be negative), with
`rollout_id` itself as the charts' x-axis; a (resumed) tracker first finds the next step W&B
does not hold yet, then skips records below it and replays the ones from metrics.jsonl that W&B
is missing (killed before they reached it). Points a killed process logged past its checkpoint
stay in W&B; the resumed run reproduces the same values, so they are not logged again. Online,
W&B itself says the next step of a resumed run (`run.step`); offline, it starts every process
at 0, so the offline files this run id left in --wandb-dir are read back
with W&B's own reader (`wandb leet inspect --json`).

TensorBoard takes negative steps and logs at `rollout_id`; a resumed process hides the points
a killed one logged past the checkpoint (`purge_step`).

The W&B run id lives in the checkpoint's trainer state, so a resumed run continues the same run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mileage.config import option
from mileage.errors import UserError
from mileage.metrics import EVAL_BEFORE_TRAINING

WANDB_MODES = ("online", "offline", "disabled")
# the version mileage is tested with; offline resume reads W&B's files with its `leet inspect`
WANDB_VERSION = "0.31.0"
WANDB_INSTALL_HINT = f"pip install 'wandb=={WANDB_VERSION}'"


@dataclass
class TrackingConfig:
    use_tensorboard: bool = option(False, "also log metrics to SAVE/tensorboard")
    use_wandb: bool = option(False, f"also log metrics to Weights & Biases ({WANDB_INSTALL_HINT})")
    wandb_project: str = option("mileage", "W&B project")
    wandb_group: str | None = option(None, "W&B group")
    wandb_mode: str = option(
        "online",
        "W&B mode (offline needs no network; upload later with `wandb sync`)",
        choices=WANDB_MODES,
    )
    wandb_dir: str | None = option(
        None, "directory for W&B's local files (default: --save, else the working directory)"
    )


def check_tracking(cfg: TrackingConfig) -> None:
    """Before anything is written: the tracker packages asked for are installed."""
    import importlib.util

    if not cfg.use_wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise UserError(f"--use-wandb needs the wandb package: {WANDB_INSTALL_HINT}")
    installed = installed_wandb_version()
    if cfg.wandb_mode == "offline" and _release(installed) < _release(WANDB_VERSION):
        raise UserError(
            f"--wandb-mode offline reads the run's earlier offline files back on resume with "
            f"`wandb leet inspect` of wandb {WANDB_VERSION}; wandb {installed} is installed: "
            f"{WANDB_INSTALL_HINT}"
        )


def installed_wandb_version() -> str:
    from importlib.metadata import version

    return version("wandb")


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as 0.31.0 or 0.32.0rc1."""
    parts = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(p or 0) for p in parts.groups()) if parts else (0, 0, 0)


def new_wandb_run_id() -> str:
    # from the OS, not from the `random`/torch generators, whose states are checkpointed
    return secrets.token_hex(4)


class TensorBoardTracker:
    """Logs at step `rollout_id`; a resumed process hides what a killed one logged past the
    point metrics.jsonl was cut back to (TensorBoard's purge_step), so each step shows once."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.writer = None  # opened by catch_up, which knows where this process starts

    def catch_up(self, records: list[dict]) -> None:
        """TensorBoard keeps what it logged before a kill: nothing to replay, the rest purged."""
        from torch.utils.tensorboard import SummaryWriter

        start = records[-1]["rollout_id"] + 1 if records else EVAL_BEFORE_TRAINING
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start)

    def log(self, record: dict) -> None:
        if self.writer is None:  # not resumed through MetricsLog.truncate_from: nothing to purge
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir))
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["rollout_id"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def scalars(record: dict) -> dict[str, float]:
    return {
        key: value
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "rollout_id"
    }


def wandb_step(record: dict) -> int:
    """The W&B step of a metrics record: rollout N is step N+1, the evaluation before training 0."""
    return record["rollout_id"] + 1


class WandbTracker:
    """One W&B run per mileage run; each record is the point at `wandb_step`, exactly once."""

    def __init__(self, cfg: TrackingConfig, run_id: str, directory: Path, name: str, config: dict):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb_project,
            group=cfg.wandb_group,
            mode=cfg.wandb_mode,
            dir=str(directory),
            id=run_id,
            name=name,
            resume="allow",
            config=config,
            settings=wandb.Settings(
                console="off", silent=True, x_disable_stats=True, save_code=False
            ),
        )
        # charts against the rollout, so that the evaluation before training sits at -1
        self.run.define_metric("rollout_id")
        self.run.define_metric("*", step_metric="rollout_id")
        self.next_step = 0
        if cfg.wandb_mode == "online":
            self.next_step = self.run.step
        elif cfg.wandb_mode == "offline":
            own = Path(self.run.dir).parent
            self.next_step = offline_next_step(directory / "wandb", run_id, exclude=own)

    def catch_up(self, records: list[dict]) -> None:
        """Log the checkpointed records W&B lacks (their process was killed before it got them)."""
        for record in records:
            self.log(record)

    def log(self, record: dict) -> None:
        step = wandb_step(record)
        if step >= self.next_step:
            self.run.log({**scalars(record), "rollout_id": record["rollout_id"]}, step=step)
            self.next_step = step + 1

    def close(self) -> None:
        self.run.finish()


def build_trackers(
    cfg: TrackingConfig, save_dir: str | None, wandb_run_id: str | None, config: dict
) -> list:
    trackers: list = []
    if cfg.use_tensorboard and save_dir:
        trackers.append(TensorBoardTracker(Path(save_dir) / "tensorboard"))
    if cfg.use_wandb and cfg.wandb_mode != "disabled":
        directory = Path(cfg.wandb_dir or save_dir or ".")
        name = Path(save_dir).resolve().name if save_dir else None
        trackers.append(WandbTracker(cfg, wandb_run_id, directory, name, config))
    return trackers


# --- reading W&B's offline files back ------------------------------------------------------
# With W&B's own reader: `wandb leet inspect --json FILE` (checked with WANDB_VERSION) prints
# each record of a .wandb transaction log as one JSON line. It checks
# each record's checksum and stops quietly at a torn tail, which is what a killed writer leaves.

WANDB_READ_TIMEOUT = 300.0  # seconds for one file; W&B's reader starts its core binary


def read_wandb_history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) for every history row in one .wandb file, in the order logged."""
    if not path.is_file():
        raise UserError(f"cannot read the W&B offline file {path}: it does not exist")
    # offline: W&B's CLI would otherwise report its own errors to the W&B server
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=WANDB_READ_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"W&B's reader (wandb leet inspect) did not finish reading {path} within "
            f"{WANDB_READ_TIMEOUT:.0f}s"
        ) from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise UserError(
            f"W&B's reader (wandb leet inspect) could not read {path}: {why}; move that "
            f"directory away to resume without its points (--wandb-mode offline needs "
            f"{WANDB_INSTALL_HINT})"
        )
    rows = []
    for line in done.stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise UserError(
                f"W&B's reader (wandb leet inspect) printed a line that is not JSON for {path}: "
                f"{line[:80]!r} (--wandb-mode offline needs {WANDB_INSTALL_HINT})"
            ) from None
        if record.get("type") != "history":
            continue
        history = record["history"]
        # proto3 JSON may leave out a field at its zero value: step 0
        step = int(history.get("step", {}).get("num", 0))
        rows.append((step, {k: _number(v) for k, v in history.get("item", {}).items()}))
    return rows


def _number(value: object) -> object:
    """The reader prints non-finite floats as proto3 JSON strings; mileage logs only numbers."""
    return float(value) if value in ("NaN", "Infinity", "-Infinity") else value


def offline_run_files(wandb_root: Path, run_id: str) -> list[Path]:
    """The .wandb files of every offline process of run `run_id`, oldest first."""
    return sorted(wandb_root.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def offline_next_step(wandb_root: Path, run_id: str, exclude: Path | None = None) -> int:
    steps = [
        step
        for file in offline_run_files(wandb_root, run_id)
        if exclude is None or file.parent != exclude
        for step, _ in read_wandb_history(file)
    ]
    return max(steps) + 1 if steps else 0
