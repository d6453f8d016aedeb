"""The on-disk layout of a save directory (Megatron-compatible names) and how to read it.

    SAVE/latest_checkpointed_iteration.txt   "N" (last complete rollout) or "release"
    SAVE/iter_{N:07d}/                      one committed checkpoint
        model/  optimizer/                  torch.distributed.checkpoint (DCP) directories
        rng.safetensors  trainer_state.json meta.json
        critic/                             PPO only: the critic's model/, optimizer/ and meta.json,
                                            written in the same staging directory (one commit)
        manifest.json                       size + sha256 of every other file; written last
    SAVE/release/                           weights-only checkpoint (model/, meta.json, manifest)
    SAVE/.staging-*                         a save in progress; never read, removed at start

`scan_dir` reads a directory into a `DirState` snapshot without loading any tensor; the resume
plan is a pure function of such snapshots.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
MANIFEST = "manifest.json"
META = "meta.json"
STAGING_PREFIX = ".staging-"
CRITIC_DIR = "critic"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def iter_dir_name(rollout_id: int) -> str:
    return f"iter_{rollout_id:07d}"


def checkpoint_path(save_dir: str | Path, rollout_id: int | str) -> Path:
    name = RELEASE if rollout_id == RELEASE else iter_dir_name(int(rollout_id))
    return Path(save_dir) / name


@dataclass(frozen=True)
class Tracker:
    """What the tracker file says: `iteration`, `release`, `invalid`, or absent (`exists=False`)."""

    exists: bool
    raw: str = ""
    iteration: int | None = None
    release: bool = False

    @property
    def valid(self) -> bool:
        return self.exists and (self.release or self.iteration is not None)


def parse_tracker(text: str) -> Tracker:
    value = text.strip()
    if value == RELEASE:
        return Tracker(True, text, release=True)
    if value.isdigit():  # rejects "", "-1", "3.0", " 1 2"
        return Tracker(True, text, iteration=int(value))
    return Tracker(True, text)


def read_tracker(save_dir: str | Path) -> Tracker:
    path = Path(save_dir) / TRACKER
    if not path.is_file():
        return Tracker(False)
    return parse_tracker(path.read_text(encoding="utf-8", errors="replace"))


@dataclass(frozen=True)
class CheckpointInfo:
    """One iter_N or release directory, as found on disk (cheap checks only: no checksums)."""

    path: str
    complete: bool
    problem: str = ""  # why it is not complete
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    # critic/meta.json of a PPO checkpoint; None when the checkpoint holds no critic
    critic_meta: dict | None = field(default=None, hash=False, compare=False)


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Complete = manifest present, every listed file present at its recorded size, meta readable."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return CheckpointInfo(str(path), False, "no manifest.json (the save did not finish)")
    try:
        manifest = json.loads(manifest_file.read_text())
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        return CheckpointInfo(str(path), False, f"unreadable manifest or meta ({exc})")
    if "model/.metadata" not in manifest["files"]:
        return CheckpointInfo(str(path), False, "the manifest lists no model", meta)
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return CheckpointInfo(str(path), False, f"missing file {name}", meta)
        if file.stat().st_size != entry["size"]:
            return CheckpointInfo(str(path), False, f"{name} has the wrong size", meta)
    critic_meta = None
    if f"{CRITIC_DIR}/{META}" in manifest["files"]:
        try:
            critic_meta = json.loads((path / CRITIC_DIR / META).read_text())
        except (OSError, ValueError) as exc:
            return CheckpointInfo(str(path), False, f"unreadable critic meta ({exc})", meta)
    return CheckpointInfo(str(path), True, "", meta, critic_meta)


@dataclass(frozen=True)
class DirState:
    """Everything the resume plan needs to know about one directory."""

    path: str
    exists: bool
    tracker: Tracker = Tracker(False)
    checkpoints: dict[int, CheckpointInfo] = field(default_factory=dict)
    release: CheckpointInfo | None = None
    hf_config: dict | None = None  # config.json when the directory is an HF model
    hf_weights: bool = False
    staging: tuple[str, ...] = ()

    @property
    def is_hf(self) -> bool:
        return self.hf_config is not None and self.hf_weights

    @property
    def is_native(self) -> bool:
        return self.tracker.exists or bool(self.checkpoints) or self.release is not None

    @property
    def complete_ids(self) -> list[int]:
        return sorted(i for i, c in self.checkpoints.items() if c.complete)


def scan_dir(path: str | Path | None) -> DirState | None:
    if path is None:
        return None
    root = Path(path)
    if not root.is_dir():
        return DirState(str(path), exists=False)
    checkpoints, staging = {}, []
    release = None
    for entry in sorted(os.listdir(root)):
        match = _ITER_RE.match(entry)
        if match and (root / entry).is_dir():
            checkpoints[int(match.group(1))] = inspect_checkpoint(root / entry)
        elif entry == RELEASE and (root / entry).is_dir():
            release = inspect_checkpoint(root / entry)
        elif entry.startswith(STAGING_PREFIX):
            staging.append(entry)
    hf_config = None
    if (root / "config.json").is_file():
        try:
            hf_config = json.loads((root / "config.json").read_text())
        except ValueError:
            hf_config = None
    hf_weights = any((root / name).exists() for name in _HF_WEIGHTS)
    return DirState(
        str(path),
        True,
        read_tracker(root),
        checkpoints,
        release,
        hf_config,
        hf_weights,
        tuple(staging),
    )


ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_theta",
    "hidden_act",
)


def architecture(config: dict) -> dict:
    """The config fields that decide tensor names and shapes (what a checkpoint must match)."""
    return {k: config[k] for k in ARCH_KEYS if k in config}


def fingerprint(config: dict) -> str:
    arch = json.dumps(architecture(config), sort_keys=True)
    return hashlib.sha256(arch.encode()).hexdigest()[:16]


def config_differences(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for each architecture field that differs."""
    a, b = architecture(saved), architecture(current)
    return [f"{k}: {a.get(k)} -> {b.get(k)}" for k in ARCH_KEYS if a.get(k) != b.get(k)]
