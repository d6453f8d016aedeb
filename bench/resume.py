"""Benchmark 4: resume latency, from launching `mileage train` to the first new rollout's generation.

Resume = `mileage train --load CKPT --save CKPT` where CKPT holds a checkpoint of rollout 0 (made
once at the start by running the same flags with `--num-rollout 1`); fresh = the same command
with an empty, new `--load/--save` directory. Both use `--num-rollout 2 --eval-interval 0`, so
neither evaluates before its first rollout and the resume starts at rollout 1.

"Generation of the first new rollout starts" is the fault point `rollout_start` in `loop.py`
(after the prompts are taken, right before `generate_samples`). The product prints nothing
there, so each run sets the existing test hook `MILEAGE_KILL_AT=rollout_start`: the process
SIGKILLs itself at that instant, and the latency is the wall time from just before `Popen` to
reaping the killed child (peak RSS from wait4). Nothing is saved before that point, so CKPT is
unchanged and every resume starts from the same state (its lock file is emptied before each run,
as a clean stop leaves it).

Two kinds of run, alternating fresh/resume and their order per repetition:
    plain    `python -m mileage train ...`: the headline latency; no benchmark code in the process
    traced   the same CLI through this script (`--trace`), which wraps mileage functions with
             timers that record wall-clock stamps and change nothing else; gives the breakdown:
             startup (interpreter), import (mileage, torch, transformers), plan (preflight, twice
             with --save), builtin (built-in model cache check), tokenizer, model (HF
             from_pretrained, or verify sha256 + empty model + DCP weights), build other (optimizer,
             engine...), restore (optimizer/RNG/data state, metrics cut), other (lock, leftovers...)
Page cache: warm by default (the files were just used); `--cold` drops the model and checkpoint
files (fadvise DONTNEED) before every run; Python's own libraries stay cached either way.

Caveat: the two starts do different amounts of work before rollout_start. A fresh start's
from_pretrained maps the safetensors file lazily (its pages are read during the first
generation) and AdamW allocates its moments at the first optimizer step; a resume reads and
hashes the whole checkpoint and allocates the optimizer state first. `--until after_train` kills
at the end of the first new rollout's training instead ("first rollout" column), which includes
those deferred costs.

    python bench/resume.py                          # built-in tiny model
    python bench/resume.py --smollm2-dir "$(mileage smollm2)" [--until after_train]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    DEFAULT_THREADS,
    load_average,
    machine_info,
    median,
    output_path,
    print_table,
    spread,
    write_results,
)
from checkpoint import drop_page_cache, output
from rl_step import run_measured

STAGES = ("startup", "import", "plan", "builtin", "tokenizer", "model", "build other", "restore")
PARTS = ("hf load", "verify", "empty model", "dcp weights", "optimizer load")


# -------------------------------------------------------------------------------- traced child


def traced_main(trace: str, argv: list[str]) -> int:
    """Run the mileage CLI in this process, appending 'label start|end|at time' lines to `trace`."""
    log = open(trace, "a")  # noqa: SIM115 - stays open until the process is killed

    def mark(label: str, what: str = "at") -> None:
        log.write(f"{label}\t{what}\t{time.time()!r}\n")
        log.flush()

    mark("python")
    import mileage.cli.main as cli
    import mileage.cli.train as train
    from mileage import build, components, loop
    from mileage.checkpoint import store

    mark("imported")

    def wrap(module, name: str, label: str) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            mark(label, "start")
            try:
                return original(*args, **kwargs)
            finally:
                mark(label, "end")

        setattr(module, name, timed)

    for module, name, label in (
        (train, "preflight", "plan"),
        (train, "build_run", "build_run"),
        (components, "ensure_builtin_model", "builtin"),
        (components, "load_tokenizer", "tokenizer"),
        (build, "load_weights", "model"),
        (build, "load_causal_lm", "hf load"),
        (store, "verify_checkpoint", "verify"),  # called by require_intact, in store
        (build, "empty_causal_lm", "empty model"),
        (build, "load_model_weights", "dcp weights"),
        (loop, "restore", "restore"),
        (components, "load_optimizer_tensors", "optimizer load"),
    ):
        wrap(module, name, label)
    fault_point = loop.fault_point

    def marked_fault_point(name: str, *args) -> None:
        if name in ("rollout_start", "after_train"):
            mark(name)  # the first of each is the first new rollout's
        fault_point(name, *args)

    loop.fault_point = marked_fault_point
    return cli.main(argv)


def read_trace(path: Path, t0: float, until: str) -> dict:
    """Seconds per stage from a trace file; `t0` is the launch time."""
    spans: dict[str, float] = {}
    points: dict[str, float] = {}
    opened: dict[str, float] = {}
    for line in path.read_text().splitlines():
        label, what, stamp = line.split("\t")
        t = float(stamp) - t0
        if what == "at":
            points.setdefault(label, t)
        elif what == "start":
            opened[label] = t
        else:
            spans[label] = spans.get(label, 0.0) + t - opened.pop(label)
    total = points[until]
    out = {
        "total": total,
        "startup": points["python"],
        "import": points["imported"] - points["python"],
    }
    for label in ("plan", "builtin", "tokenizer", "model", "restore", *PARTS):
        out[label] = spans.get(label, 0.0)
    out["build other"] = (
        spans.get("build_run", 0.0) - out["builtin"] - out["tokenizer"] - out["model"]
    )
    out["first rollout"] = total - points["rollout_start"]
    out["other"] = total - sum(out[s] for s in (*STAGES, "first rollout"))
    return out


# -------------------------------------------------------------------------------- parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smollm2-dir", help="HF model directory (default: the built-in tiny model)")
    p.add_argument(
        "--repeats", type=int, default=5, help="runs of each kind (fresh/resume x plain/traced)"
    )
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--until", choices=("rollout_start", "after_train"), default="rollout_start")
    p.add_argument(
        "--cold", action="store_true", help="drop model/checkpoint files from the page cache"
    )
    p.add_argument(
        "--out",
        help="results name or file (default resume_tiny / resume_smollm2; see rl_step.py --help)",
    )
    p.add_argument("--trace", help=argparse.SUPPRESS)  # internal: run the CLI traced
    return p.parse_args(argv)


def train_args(model_dir: str | None, threads: int, num_rollout: int, directory: Path) -> list[str]:
    args = ["train", "--num-rollout", str(num_rollout), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
            "--eval-interval", "0", "--num-threads", str(threads),
            "--load", str(directory), "--save", str(directory)]  # fmt: skip
    return args + (["--hf-checkpoint", model_dir] if model_dir else [])


def launch(kind: str, args: list[str], cold_paths: list[Path], until: str) -> dict:
    """One run killed at `until`; wall seconds, peak RSS and (traced) the breakdown."""
    for path in cold_paths:
        drop_page_cache(path)
    env = {"MILEAGE_KILL_AT": until}
    with tempfile.TemporaryDirectory(prefix="bench-resume-trace-") as tmp:
        trace = Path(tmp) / "trace.tsv"
        if kind == "plain":
            cmd = [sys.executable, "-m", "mileage", *args]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--trace", str(trace), "--", *args]  # fmt: skip
        t0 = time.time()
        code, wall, rss, log = run_measured(cmd, env=env)
        if code != -9:
            raise RuntimeError(f"no SIGKILL at {until} (exit {code}):\n{log[-3000:]}")
        result = {"wall_s": wall, "peak_rss_mib": rss}
        if kind == "traced":
            result["stages"] = read_trace(trace, t0, until)
    return result


def main(argv=None) -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--trace" and argv is None:
        sep = sys.argv.index("--")
        return traced_main(sys.argv[2], sys.argv[sep + 1 :])
    args = parse_args(argv)
    model = "smollm2" if args.smollm2_dir else "tiny"
    out = output_path(args.out or f"resume_{model}")  # before measuring, not after it
    from mileage.rollout.builtin_model import ensure_builtin_model

    model_dir = args.smollm2_dir or str(ensure_builtin_model("addition"))
    info = machine_info(args.threads)
    dirty = " + uncommitted mileage/" if output("git", "status", "--porcelain", "mileage") else ""
    info["code"] = output("git", "rev-parse", "--short", "HEAD") + dirty
    print(
        f"machine: {info['cpu']}, {args.threads} threads, load {load_average()}; model {model_dir}"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    ckpt = work / "ckpt"
    try:
        prepare = [sys.executable, "-m", "mileage", *train_args(args.smollm2_dir, args.threads, 1, ckpt)]  # fmt: skip
        code, _, _, log = run_measured(prepare)  # rollout 0, saved: what the resumes start from
        if code != 0:
            raise RuntimeError(f"preparing the checkpoint failed ({code}):\n{log[-3000:]}")
        results: dict[str, list[dict]] = {}
        for rep in range(args.repeats):
            order = ["fresh", "resume"] if rep % 2 == 0 else ["resume", "fresh"]
            for kind in ("plain", "traced") if rep % 2 == 0 else ("traced", "plain"):
                for start in order:
                    if start == "fresh":
                        target = work / f"fresh-{rep}-{kind}"
                    else:
                        target = ckpt
                        (ckpt / ".mileage.lock").write_text("")  # as a clean stop leaves it
                    run_args = train_args(args.smollm2_dir, args.threads, 2, target)
                    cold = [Path(model_dir), ckpt] if args.cold else []
                    result = launch(kind, run_args, cold, args.until)
                    results.setdefault(f"{start} {kind}", []).append(result)
                    shutil.rmtree(work / f"fresh-{rep}-{kind}", ignore_errors=True)
                    print(f"  rep {rep} {start:6} {kind:6}: {result['wall_s']:.2f} s, "
                          f"{result['peak_rss_mib']:.0f} MiB, load {load_average()}", flush=True)  # fmt: skip
        ckpt_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for name, runs in results.items():
        walls = [r["wall_s"] for r in runs]
        row = {"run": name, "s": median(walls), "range": spread(walls),
               "peak_rss_mib": max(r["peak_rss_mib"] for r in runs)}  # fmt: skip
        if "stages" in runs[0]:
            for stage in (*STAGES, "first rollout", "other", *PARTS):
                row[stage] = median([r["stages"][stage] for r in runs])
        rows.append(row)
    rows.sort(key=lambda r: (r["run"].split()[1], r["run"]))
    by_name = {r["run"]: r for r in rows}
    extra = by_name["resume plain"]["s"] - by_name["fresh plain"]["s"]
    note = (f"resume - fresh (plain): {extra:+.2f} s; checkpoint {ckpt_bytes / 1e6:.1f} MB; "
            f"page cache {'dropped before each run' if args.cold else 'warm'}")  # fmt: skip
    columns = [("run", "run"), ("s", f"s to {args.until} (median)"), ("range", "(range)"),
               ("peak_rss_mib", "peak RSS MiB")]  # fmt: skip
    stages = (*STAGES, "first rollout") if args.until == "after_train" else STAGES
    columns += [(s, s) for s in (*stages, "other")]
    table = print_table(rows, columns)
    parts = print_table(
        [r for r in rows if "model" in r], [("run", "run"), *[(p, p) for p in PARTS]]
    )
    print(note)
    write_results(
        out,
        {
            "benchmark": "resume",
            "machine": {**info, "load_average_end": load_average()},
            "settings": {**vars(args), "model_dir": model_dir},
            "rows": rows,
            "note": note,
            "raw": results,
            "table": table + "\n\n" + parts,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
