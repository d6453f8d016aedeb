"""Compares two save directories of the same `mileage train` command, tensor by tensor.

Used by the crash-anywhere harness (`mileage.testing.crash`) and `scripts/soak.py`: a run that
was killed and rerun must equal the uninterrupted run in every model, optimizer and RNG tensor
of every checkpoint (`torch.equal`; with PPO the critic's too), in the trainer state and
meta.json, and in metrics.jsonl with the wall-clock keys left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from mileage.checkpoint.layout import (
    CRITIC_DIR,
    META,
    STAGING_PREFIX,
    checkpoint_path,
    read_tracker,
    scan_dir,
)
from mileage.checkpoint.store import TRAINER_STATE, verify_checkpoint
from mileage.checkpoint.tensors import (
    MODEL_DIR,
    OLD_ACTOR_FILE,
    OPTIMIZER_DIR,
    RNG_FILE,
    load_tensors,
)
from mileage.metrics import METRICS_FILE, TIMING_KEYS

# a difference in tensor names, shapes, dtypes or values starts with this
TENSOR_DIFF = "tensor "
# a directory left behind by an interrupted save starts with this
LEFTOVER_DIFF = "leftover "
# meta.json keys that legitimately differ between two runs of the same command
VOLATILE_META = frozenset({"time", "host"})


def compare_runs(save_a: str | Path, save_b: str | Path) -> list[str]:
    """Every difference between two save directories ([] = identical where it matters).

    Compares the trackers, the set of complete checkpoints, and in each checkpoint both runs
    have: every model, optimizer, RNG and kept old-actor tensor (names, dtypes, shapes, `torch.equal`), the
    trainer state and meta.json (minus time and host); then metrics.jsonl minus timing keys.
    Also reports leftovers of interrupted saves (starting with `LEFTOVER_DIFF`) and a tracker
    naming a corrupt checkpoint. Tensor differences start with `TENSOR_DIFF`.
    """
    a, b = Path(save_a), Path(save_b)
    diffs = []
    track_a, track_b = read_tracker(a), read_tracker(b)
    if (track_a.iteration, track_a.release) != (track_b.iteration, track_b.release):
        diffs.append(f"tracker: {track_a.raw.strip()!r} vs {track_b.raw.strip()!r}")
    ids_a, ids_b = set(scan_dir(a).complete_ids), set(scan_dir(b).complete_ids)
    for rollout_id in sorted(ids_a ^ ids_b):
        where = a if rollout_id in ids_a else b
        diffs.append(f"checkpoint {checkpoint_path(where, rollout_id).name}: only in {where}")
    for rollout_id in sorted(ids_a & ids_b):
        diffs += compare_checkpoints(checkpoint_path(a, rollout_id), checkpoint_path(b, rollout_id))
    diffs += compare_metrics(a, b)
    for root, tracker in ((a, track_a), (b, track_b)):
        leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(STAGING_PREFIX))
        if leftovers:
            diffs.append(f"{LEFTOVER_DIFF}of interrupted saves in {root}: {', '.join(leftovers)}")
        if tracker.iteration is not None:
            diffs += [
                f"{root}: {p}" for p in verify_checkpoint(checkpoint_path(root, tracker.iteration))
            ]
    return diffs


def compare_checkpoints(ckpt_a: str | Path, ckpt_b: str | Path) -> list[str]:
    """Differences between two checkpoint directories of the same rollout."""
    a, b = Path(ckpt_a), Path(ckpt_b)
    name = a.name
    diffs = []
    critic_model, critic_optimizer = f"{CRITIC_DIR}/{MODEL_DIR}", f"{CRITIC_DIR}/{OPTIMIZER_DIR}"
    for sub in (MODEL_DIR, OPTIMIZER_DIR, critic_model, critic_optimizer):
        present = ((a / sub / ".metadata").is_file(), (b / sub / ".metadata").is_file())
        if present == (True, True):
            diffs += compare_tensors(f"{name}/{sub}", load_tensors(a / sub), load_tensors(b / sub))
        elif present != (False, False):
            diffs.append(f"{TENSOR_DIFF}{name}/{sub}: present in only one run")
    for file in (RNG_FILE, OLD_ACTOR_FILE):
        if (a / file).is_file() and (b / file).is_file():
            diffs += compare_tensors(
                f"{name}/{file}", load_file(str(a / file)), load_file(str(b / file))
            )
        elif (a / file).is_file() != (b / file).is_file():
            diffs.append(f"{TENSOR_DIFF}{name}/{file}: present in only one run")
    for json_name, ignored in (
        (TRAINER_STATE, frozenset()),
        (META, VOLATILE_META),
        (f"{CRITIC_DIR}/{META}", VOLATILE_META),
    ):
        doc_a, doc_b = _read_json(a / json_name), _read_json(b / json_name)
        doc_a = {k: v for k, v in doc_a.items() if k not in ignored}
        doc_b = {k: v for k, v in doc_b.items() if k not in ignored}
        for key in sorted(set(doc_a) | set(doc_b)):
            if doc_a.get(key) != doc_b.get(key):
                diffs.append(f"{name}/{json_name}: {key} differs")
    return diffs


def compare_tensors(
    where: str, tensors_a: dict[str, torch.Tensor], tensors_b: dict[str, torch.Tensor]
) -> list[str]:
    """One line per tensor that is missing on one side or differs in dtype, shape or values."""
    diffs = []
    for key in sorted(set(tensors_a) ^ set(tensors_b)):
        side = "first" if key in tensors_a else "second"
        diffs.append(f"{TENSOR_DIFF}{where}/{key}: only in the {side} run")
    for key in sorted(set(tensors_a) & set(tensors_b)):
        ta, tb = tensors_a[key], tensors_b[key]
        if ta.dtype != tb.dtype:
            diffs.append(f"{TENSOR_DIFF}{where}/{key}: dtype {ta.dtype} vs {tb.dtype}")
        elif ta.shape != tb.shape:
            diffs.append(
                f"{TENSOR_DIFF}{where}/{key}: shape {tuple(ta.shape)} vs {tuple(tb.shape)}"
            )
        elif not torch.equal(ta, tb):
            unequal = int((ta != tb).sum())
            detail = f"{unequal} of {ta.numel()} elements differ"
            if ta.is_floating_point():
                detail += f", max abs diff {float((ta.double() - tb.double()).abs().max()):.3g}"
            diffs.append(f"{TENSOR_DIFF}{where}/{key}: {detail}")
    return diffs


def compare_metrics(save_a: str | Path, save_b: str | Path) -> list[str]:
    """Differences between two metrics.jsonl files, timing keys (`TIMING_KEYS`) left out."""
    records_a = _comparable_metrics(Path(save_a))
    records_b = _comparable_metrics(Path(save_b))
    if isinstance(records_a, str) or isinstance(records_b, str):
        return [r for r in (records_a, records_b) if isinstance(r, str)]
    diffs = []
    ids_a = [r.get("rollout_id") for r in records_a]
    ids_b = [r.get("rollout_id") for r in records_b]
    if ids_a != ids_b:
        diffs.append(f"metrics: rollout ids {ids_a} vs {ids_b}")
    for rec_a, rec_b in zip(records_a, records_b, strict=False):
        keys = sorted(k for k in set(rec_a) | set(rec_b) if rec_a.get(k) != rec_b.get(k))
        if keys:
            diffs.append(f"metrics: rollout {rec_a.get('rollout_id')}: {', '.join(keys)} differ")
    return diffs


def _comparable_metrics(save_dir: Path) -> list[dict] | str:
    path = save_dir / METRICS_FILE
    if not path.is_file():
        return f"metrics: {path} is missing"
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            return f"metrics: {path} line {number} is not JSON"
        records.append({k: v for k, v in record.items() if k not in TIMING_KEYS})
    return records


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def count_tensor_differences(diffs: Iterable[str]) -> int:
    return sum(1 for d in diffs if d.startswith(TENSOR_DIFF))


def learning_problems(save_dir: str | Path, start_weights_dir: str | Path) -> list[str]:
    """Why a run may not have learned ([] = it did): a comparison of two runs that never changed
    their weights would pass whether or not resume works.

    Requires a rollout with a gradient norm above 0 in metrics.jsonl, and final weights (the
    checkpoint the tracker names) that differ from the HF weights in `start_weights_dir`.
    """
    from safetensors import safe_open

    save_dir, start_dir = Path(save_dir), Path(start_weights_dir)
    problems = []
    records = _comparable_metrics(save_dir)
    if isinstance(records, str):
        return [records]
    norms = [r.get("grad_norm", 0.0) for r in records]
    if not any(n > 0 for n in norms):
        problems.append(f"no rollout had a gradient norm above 0 ({norms})")
    tracked = read_tracker(save_dir).iteration
    if tracked is None:
        return [*problems, f"{save_dir} has no tracked checkpoint"]
    final = load_tensors(checkpoint_path(save_dir, tracked) / MODEL_DIR)
    start = {}
    for file in sorted(start_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            start.update({k: handle.get_tensor(k) for k in handle.keys() if k in final})  # noqa: SIM118
    if not start:
        problems.append(f"no tensor of {start_dir} matches the checkpoint's names")
    elif all(torch.equal(start[k], final[k]) for k in start):
        problems.append(f"the final weights equal the starting weights of {start_dir}")
    return problems
