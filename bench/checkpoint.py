"""Benchmark 3: checkpoint save and load of the full training state, against raw disk and torch.save.

The state is built as `mileage train` builds it (mileage's parser, RunConfig, preflight,
build_run), after one real `Actor.train_rollout` on a synthetic 2-sample GRPO batch so the AdamW
moments exist; saves are the loop's own `run.writer.save(N, checkpoint_state(run, N))`.
SmolLM2-135M: fp32 weights + AdamW, ~1.7 GB. Per repetition, in one directory (one disk):
    raw write/read  dd of the same byte count (`bs=16M conv=fdatasync`; read `iflag=direct`)
    mileage save    --saves saves per process (as with --save-interval): the last one, and the
                    first. sync: split into DCP tensor writing, fsync, sha256 for the manifest
                    and the rest (wall-clock spans of os.fsync, store.save_tensors and
                    store.file_sha256, wrapped). async: the time the loop is blocked in
                    writer.save() vs until writer.wait() returns (the main thread idles here)
    torch.save      the same CheckpointState fields in one file, fsync after
    mileage load    as a resume: build.load_weights + restore, into an empty model and a
                    fresh AdamW after configure_determinism; "+verify" re-hashes every file first
    torch.load      `weights_only=True` of the torch.save file
Writes (rotating order) each follow `sync` + a --settle pause; loads (rotating order) read a
cold page cache (fsync + posix_fadvise DONTNEED per file; fincore's resident bytes are shown).
Each operation is a fresh child process: "proc peak" = its peak RSS (wait4, includes building
the model), "op peak +" = growth of peak RSS during the operation (VmHWM via clear_refs).

    python bench/checkpoint.py                       # SmolLM2-135M (the `mileage smollm2` dir)
    python bench/checkpoint.py --model tiny          # built-in 3.2M model, a quick dev run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import _common as common
from _common import median, spread
from rl_step import run_measured

if TYPE_CHECKING:
    from mileage.components import Run

GB = 1e9
SPANS: dict[str, list[tuple[float, float]]] = {}  # child process: wall-clock spans of calls


def files_under(path: str | Path) -> list[Path]:
    path = Path(path)
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def tree_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def output(*cmd: str) -> str:
    return subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True).stdout.strip()


def drop_page_cache(path: str | Path) -> int:
    """fsync + POSIX_FADV_DONTNEED every file under `path`; bytes still resident (fincore)."""
    files = files_under(path)
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not shutil.which("fincore"):
        return -1
    return sum(map(int, output("fincore", "-b", "-n", "-r", "-o", "RES", *map(str, files)).split()))


def raw_disk(directory: Path, nbytes: int) -> tuple[dict, dict]:
    def dd(args: list[str]) -> dict:
        out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
        match = re.search(r"(\d+) bytes .* copied, ([\d.e-]+) s", out)
        return {"bytes": int(match.group(1)), "s": float(match.group(2))}

    file, count = directory / "dd.bin", max(1, -(-nbytes // (16 << 20)))
    try:
        write = dd(["if=/dev/zero", f"of={file}", "bs=16M", f"count={count}", "conv=fdatasync"])
        drop_page_cache(file)
        return write, dd([f"if={file}", "of=/dev/null", "bs=16M", "iflag=direct"])
    finally:
        file.unlink(missing_ok=True)


# -------------------------------------------------------------------------------- child process


@contextlib.contextmanager
def rss_growth(result: dict) -> Iterator[None]:
    """result["op_rss_growth_mib"]: growth of peak RSS over the block (VmHWM reset by clear_refs;
    without it, the growth over the lifetime peak, a lower bound)."""

    def status(key: str) -> float:  # MiB
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{key}:\s+(\d+)", text, re.M)[1]) / 1024

    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    yield
    result["op_rss_growth_mib"] = status("VmHWM") - before


def record_spans(owner: object, name: str, key: str) -> None:
    """Wrap owner.name to append the wall-clock (start, end) of every call to SPANS[key]."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPANS.setdefault(key, []).append((start, time.perf_counter()))

    setattr(owner, name, timed)


def covered(intervals: list[tuple[float, float]]) -> float:
    """Wall seconds during which at least one of the intervals was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total, reach = total + end - max(start, reach), end
    return total


def sync_breakdown(start: float, end: float) -> dict:
    """tensor write + fsync|sha256 + other = total; fsync and sha256 may overlap in threads."""
    tensors, fsyncs, hashes = ([(a, b) for a, b in SPANS.get(k, []) if start <= a and b <= end]
                               for k in ("save_tensors", "fsync", "sha256"))  # fmt: skip
    in_dcp = [(a, b) for a, b in fsyncs if any(a >= s and b <= e for s, e in tensors)]
    tensor_write, flush_hash = covered(tensors) - covered(in_dcp), covered(fsyncs + hashes)
    return {"tensor write": tensor_write, "fsync": covered(fsyncs), "sha256": covered(hashes),
            "fsync|sha256": flush_hash, "other": end - start - tensor_write - flush_hash}  # fmt: skip


def trained_run(hf_dir: str | None, threads: int, save: Path | None, extra: tuple = ()) -> Run:
    """A Run as `mileage train` builds it (parser, RunConfig, preflight, build_run), after one
    real Actor.train_rollout on a synthetic group of 2 sequences, so the AdamW state exists."""
    import torch

    import mileage.components as components
    from mileage.cli.main import build_parser
    from mileage.run_config import RunConfig
    from mileage.training.actor import sequence_logprobs
    from mileage.training.batch import TrainBatch

    argv = ["train", "--num-threads", str(threads), "--eval-interval", "0"]
    argv += ["--rollout-batch-size", "1", "--n-samples-per-prompt", "2", *extra]
    argv += ["--hf-checkpoint", hf_dir] if hf_dir else []
    argv += ["--save", str(save)] if save else []
    cfg = RunConfig.from_args(build_parser().parse_args(argv))
    from mileage.preflight import preflight

    run = components.build_run(cfg, preflight(cfg), log=lambda _: None)
    ids = torch.randint(0, run.model.config.vocab_size, (2, 12), generator=torch.Generator())
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones(2, 11), None, torch.tensor([0.0, 1.0]))
    with torch.no_grad():
        batch.old_logprobs = sequence_logprobs(run.model, batch, 1.0)[0]
    run.actor.train_rollout(batch)
    assert run.actor.optimizer.state, "no optimizer state after one step"
    return run


def save_op(op: str, spec: dict) -> dict:
    import torch

    from mileage.checkpoint import store
    from mileage.components import checkpoint_state

    save = Path(spec["save"])
    extra = ("--async-save",) if op == "save-async" else ()
    run = trained_run(spec["hf_dir"], spec["threads"], None if op == "save-torch" else save, extra)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in run.model.state_dict().values()}  # fmt: skip
    for owner, name, key in ((os, "fsync", "fsync"), (store, "save_tensors", "save_tensors"),
                             (store, "file_sha256", "sha256"), (store.CheckpointState, "copied", "copy")):  # fmt: skip
        record_spans(owner, name, key)
    saves, result = [], {}
    with rss_growth(result):
        for rollout_id in range(spec["saves"]):
            start, entry = time.perf_counter(), {}
            if op == "save-torch":
                state = checkpoint_state(run, rollout_id)
                plain = json.loads(json.dumps({"trainer": state.trainer, "meta": state.meta}))
                with open(save / f"state{rollout_id}.pt", "wb") as handle:  # JSON parts as on disk
                    torch.save({"model": state.model, "optimizer": state.optimizer,
                                "rng": state.rng, **plain}, handle)  # fmt: skip
                    handle.flush()
                    os.fsync(handle.fileno())
            else:
                run.writer.save(rollout_id, checkpoint_state(run, rollout_id))  # the loop's call
                entry["blocked_s"] = time.perf_counter() - start
                copies = [x for x in SPANS.get("copy", []) if x[0] >= start]
                entry["snapshot copy"] = covered(copies)
                run.writer.wait()
            entry["s"] = time.perf_counter() - start
            if op == "save-sync":
                entry["breakdown"] = sync_breakdown(start, start + entry["s"])
            saves.append(entry)
    last = save / (f"state{rollout_id}.pt" if op == "save-torch" else f"iter_{rollout_id:07d}")
    result.update(saves=saves, bytes=tree_bytes(last), path=str(last))
    result["model_unique_bytes"] = sum(storages.values())
    if op == "save-sync":
        result["model_dir_bytes"] = tree_bytes(last / store.MODEL_DIR)
        hash_s = sum(b - a for a, b in SPANS["sha256"]) / len(saves)
        result["sha256_gb_s_per_thread"] = result["bytes"] / GB / hash_s
    return result


def load_op(op: str, spec: dict) -> dict:
    import torch

    from mileage.checkpoint import store
    from mileage.models.hf import empty_causal_lm
    from mileage.seeding import configure_determinism, restore_rng_state
    from mileage.training.optimizer import OptimConfig, build_optimizer

    target, parts, result = Path(spec["target"]), {}, {}
    if op != "load-torch":
        configure_determinism(1234, spec["threads"])  # as build_run does before loading
        model = empty_causal_lm(spec["config_dir"])
        optimizer = build_optimizer(model, OptimConfig())
    with rss_growth(result):
        start = mark = time.perf_counter()
        if op == "load-torch":
            torch.load(target, weights_only=True)
        if op == "load-verify":
            problems = store.verify_checkpoint(target)
            assert not problems, problems
            parts["verify"], mark = time.perf_counter() - mark, time.perf_counter()
        if op != "load-torch":
            store.load_model_weights(target, model)
            parts["weights"], mark = time.perf_counter() - mark, time.perf_counter()
            trainer = store.read_json(target, store.TRAINER_STATE)
            store.load_optimizer_tensors(target, model, optimizer)
            restore_rng_state(store.load_rng_tensors(target), trainer["rng"])
            parts["optimizer+rng"] = time.perf_counter() - mark
        seconds = time.perf_counter() - start
    result.update(s=seconds, bytes=tree_bytes(target))
    if parts:  # the tensors a load reads: model/ and optimizer/
        result.update(breakdown=parts, bytes=tree_bytes(target / "model") + tree_bytes(target / "optimizer"))  # fmt: skip
    return result


# -------------------------------------------------------------------------------- parent


def run_worker(op: str, spec: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({**spec, "op": op})]  # fmt: skip
    code, wall, rss, log = run_measured(cmd)
    if code != 0:
        raise RuntimeError(f"{op} worker failed ({code}):\n{log[-3000:]}")
    result = json.loads(log.strip().splitlines()[-1])  # the worker's last line
    if "saves" in result:  # the headline numbers are the last (steady-state) save's
        result.update(result["saves"][-1], first=result["saves"][0])
    return {**result, "proc_peak_rss_mib": rss, "process_wall_s": wall}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--hf-dir", help="HF model directory (default: `mileage smollm2` / built-in)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves", type=int, default=2, help="consecutive saves per save process")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of pause before each write")
    p.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    p.add_argument("--dir", help="where to write (default: a new temp dir under $TMPDIR)")
    p.add_argument(
        "--out", help="results name or file (default checkpoint_MODEL; see rl_step.py --help)"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one operation, as JSON
    return p.parse_args(argv)


NAMES = {"raw-write": "raw write (dd)", "save-sync": "mileage save (sync)",
         "save-async": "mileage save (async, until committed)", "save-torch": "torch.save + fsync",
         "raw-read": "raw read (dd, O_DIRECT)", "load-tensors": "mileage load (tensors)",
         "load-verify": "mileage load (+verify, as resume)", "load-torch": "torch.load(weights_only)"}  # fmt: skip
COLUMNS = [("op", "operation"), ("gb", "GB"), ("s", "s (median)"), ("range", "(range)"),
           ("gb_s", "GB/s"), ("pct_raw", "% of raw dd"), ("first", "1st save s"),
           ("blocked_s", "loop blocked s"), ("blocked_pct_sync", "blocked % of sync save"),
           ("proc_rss", "proc peak RSS MiB"), ("op_rss", "op peak + MiB"),
           ("cache", "page cache"), ("breakdown", "breakdown (s)")]  # fmt: skip


def summarize(op: str, runs: list[dict], raw: dict | None, sync_s: float) -> dict:
    def med(get) -> float:
        return median([get(r) for r in runs])

    row = {"op": NAMES[op], "gb": runs[0]["bytes"] / GB, "s": med(lambda r: r["s"]),
           "range": spread([r["s"] for r in runs]), "gb_s": med(lambda r: r["bytes"] / GB / r["s"])}  # fmt: skip
    row["pct_raw"] = 100 * row["gb_s"] / raw["gb_s"] if raw else 100.0
    if "proc_peak_rss_mib" in runs[0]:
        row["proc_rss"] = max(r["proc_peak_rss_mib"] for r in runs)
        row["op_rss"] = max(r["op_rss_growth_mib"] for r in runs)
    if "first" in runs[0]:
        row["first"] = f"{med(lambda r: r['first']['s']):.3g}"
    if "blocked_s" in runs[0] and op != "save-sync":
        row["blocked_s"] = med(lambda r: r["blocked_s"])
        row["blocked_pct_sync"] = 100 * row["blocked_s"] / sync_s
        row["first"] += f" (blocked {med(lambda r: r['first']['blocked_s']):.3g})"
        row["breakdown"] = f"snapshot copy {med(lambda r: r['snapshot copy']):.3g}"
    if "breakdown" in runs[0]:
        parts = [(k, med(lambda r, k=k: r["breakdown"][k])) for k in runs[0]["breakdown"]]
        row["breakdown"] = ", ".join(f"{k} {v:.3g}" for k, v in parts)
    if "cached_before" in runs[0]:
        row["cache"] = f"dropped ({max(r['cached_before'] for r in runs)} B resident)"
    return row


def measure(args: argparse.Namespace, base: dict, work: Path) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {op: [] for op in NAMES}
    writes, loads = ["save-sync", "raw", "save-async", "save-torch"], list(NAMES)[5:]
    for rep in range(args.repeats):
        rep_dir = work / f"rep{rep}"
        for op in writes[rep % 4 :] + writes[: rep % 4]:  # rep 0 starts with the sync save
            os.sync()
            time.sleep(args.settle)
            (rep_dir / op).mkdir(parents=True, exist_ok=True)
            if op == "raw":  # the byte count of a mileage checkpoint, in the same directory
                write, read = raw_disk(rep_dir / op, results["save-sync"][0]["bytes"])
                results["raw-write"].append(write)
                results["raw-read"].append(read)
            else:
                results[op].append(run_worker(op, {**base, "save": str(rep_dir / op)}))
        shutil.rmtree(rep_dir / "save-async")
        for op in loads[rep % 3 :] + loads[: rep % 3]:
            target = results["save-torch" if op == "load-torch" else "save-sync"][-1]["path"]
            cached = drop_page_cache(target)
            results[op].append({**run_worker(op, {**base, "target": target}), "cached_before": cached})  # fmt: skip
        shutil.rmtree(rep_dir)
        print(f"  rep {rep}: " + ", ".join(f"{op} {results[op][-1]['s']:.2f}s" for op in NAMES)
              + f", load {common.load_average()}", flush=True)  # fmt: skip
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)  # one operation in this child; the result is the last line
        # mileage imports DCP on first use (~1 s); a training process has paid that long before
        # it saves or loads, so it is not part of the operation (benchmark 4 counts it)
        import torch.distributed.checkpoint  # noqa: F401

        print(json.dumps((save_op if "save" in spec["op"] else load_op)(spec["op"], spec)))
        return 0
    out = common.output_path(args.out or f"checkpoint_{args.model}")  # before measuring
    from mileage.rollout.builtin_model import ensure_builtin_model

    if args.model == "smollm2" and not args.hf_dir:
        lines = output(sys.executable, "-m", "mileage", "smollm2").splitlines()
        args.hf_dir = next(x.strip() for x in lines if Path(x.strip()).is_dir())
    config_dir = args.hf_dir or str(ensure_builtin_model("addition"))
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    work.mkdir(parents=True, exist_ok=True)
    code = output("git", "rev-parse", "--short", "HEAD")
    code += " + uncommitted mileage/" if output("git", "status", "--porcelain", "mileage") else ""
    fs = " ".join(output("df", "--output=source,fstype,target", str(work)).split()[4:])
    info = common.machine_info(args.threads)
    print(f"machine: {info['cpu']}, {args.threads} threads, load {common.load_average()}; {code}")
    print(f"model {config_dir}; writing in {work} on {fs}", flush=True)
    base = {"hf_dir": args.hf_dir, "config_dir": config_dir, "threads": args.threads}
    try:
        results = measure(args, {**base, "saves": args.saves}, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    sync_s, rows, raw = median([r["s"] for r in results["save-sync"]]), [], None
    for op in NAMES:
        rows.append(summarize(op, results[op], None if op.startswith("raw") else raw, sync_s))
        raw = rows[-1] if op.startswith("raw") else raw
    sync = results["save-sync"][0]
    sha = median([r["sha256_gb_s_per_thread"] for r in results["save-sync"]])
    notes = [
        f"{args.model}: model/ holds {sync['model_dir_bytes'] / GB:.3f} GB on disk; the model's "
        f"unique tensor storages are {sync['model_unique_bytes'] / GB:.3f} GB (tied weights once)",
        f"sha256 for the manifest: {sha:.2f} GB/s per hashing thread (page-cache reads included)",
        "sync breakdown: tensor write (DCP, less its fsyncs) + fsync|sha256 (wall time while "
        "either ran) + other = total; fsync and sha256 alone may overlap",
        f"saves: the last of {args.saves} per process; '1st save s' is the first one",
    ]  # fmt: skip
    table = common.print_table(rows, COLUMNS)
    print("\n".join(notes))
    settings = {k: v for k, v in vars(args).items() if k != "worker"}
    machine = {**info, "filesystem": fs, "code": code, "load_average_end": common.load_average()}
    payload = {"benchmark": "checkpoint", "machine": machine, "settings": settings, "rows": rows,
               "model_dir": config_dir, "notes": notes, "raw": results, "table": table}  # fmt: skip
    common.write_results(out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
