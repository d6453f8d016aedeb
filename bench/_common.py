"""Shared plumbing for the scripts in bench/: machine description, tables, JSON results, timing.

Every benchmark records the machine it ran on (CPU model and vector extensions, cores, memory,
library versions, torch threads) and the load average before and after, because on a 2-core
machine another process changes timings far more than any code change does.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
if str(REPO) not in sys.path:  # `python bench/<name>.py` from anywhere, without installing
    sys.path.insert(0, str(REPO))

DEFAULT_THREADS = min(2, os.cpu_count() or 1)  # mileage's --num-threads default


def cpu_description() -> dict:
    """CPU model name and the vector extensions that decide fp32/bf16 matmul speed."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def matmul_limits(threads: int, sizes: tuple[int, ...] = (256, 1024)) -> dict:
    """Square-matmul GFLOP/s per precision and size on this host: the ceiling a training pass
    in that precision is measured against (torch.mm of [n, n] operands, median of 5 timed
    calls after 2 warm-up ones; bf16 operands as autocast hands them to the matmul)."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    limits: dict = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        limits[name] = {}
        for n in sizes:
            a = torch.randn(n, n, generator=gen).to(dtype)
            b = torch.randn(n, n, generator=gen).to(dtype)
            calls = max(1, int(2e9 // (2 * n**3)))  # about 2 GFLOP per timed sample
            samples = []
            for rep in range(7):
                start = time.perf_counter()
                for _ in range(calls):
                    torch.mm(a, b)
                if rep >= 2:
                    samples.append(time.perf_counter() - start)
            limits[name][str(n)] = round(2 * n**3 * calls / statistics.median(samples) / 1e9, 1)
    return limits


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    for name in ("trl", "accelerate", "datasets"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    return {
        "cpu": cpu_description(),
        "memory_gib": memory_gib(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "versions": versions,
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    """min-max as a short string, to show the run-to-run noise next to a median."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    if hi >= 100:
        return f"{lo:.0f}-{hi:.0f}"
    return f"{lo:.3g}-{hi:.3g}"


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A GitHub-markdown table of `rows` (dicts) with (key, header) columns; printed and returned."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = [
        "| " + " | ".join(header for _, header in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(key, "")) for key, _ in columns) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def results_path(out: str) -> Path:
    """Where `--out OUT` writes its JSON. A bare name (`rl_step`, `x.json`) lands in
    bench/results/; anything with a directory part (`../x.json`, `/tmp/x`, `./x`, `~/x`) is a
    path from the working directory. `.json` is added only when the name lacks it."""
    from mileage.errors import UserError

    if not out.strip():
        raise UserError("--out is empty; give a results name or a file path")
    path = Path(out).expanduser()
    if out.endswith(("/", os.sep)) or path.name in ("", ".", ".."):
        raise UserError(f"--out {out} names a directory; give a file name, e.g. {out}/result.json")
    if "/" not in out and os.sep not in out and not out.startswith("~"):  # Path drops a "./"
        path = RESULTS / path
    path = Path.cwd() / path  # an absolute path stays as it is
    if path.suffix.lower() != ".json":
        path = path.with_name(path.name + ".json")
    return path


def checked_results_path(out: str) -> Path:
    """`results_path(out)`, refused before any measuring if the JSON could not be written there."""
    from mileage.errors import UserError

    path = results_path(out)
    if path.parent == RESULTS:
        RESULTS.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise UserError(f"--out {out}: {path} is a directory; give a file name")
    if path.parent.exists() and not path.parent.is_dir():
        raise UserError(f"--out {out}: {path.parent} is not a directory")
    if not path.parent.is_dir():
        raise UserError(f"--out {out}: the directory {path.parent} does not exist")
    try:  # a real write, so a read-only file system or a root-owned directory is caught now
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write in {path.parent} ({exc.strerror})") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"--out {out}: {path} exists and is not writable")
    return path


def output_path(out: str) -> Path:
    """`checked_results_path` for a benchmark's main: a bad --out is one line and exit 2."""
    from mileage.errors import UserError

    try:
        return checked_results_path(out)
    except UserError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


def write_results(path: Path, payload: dict) -> Path:
    """Write the JSON at `path` (from `output_path`, checked before measuring), atomically."""
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    os.replace(staging, path)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    print(f"wrote {shown}", flush=True)
    return path


class Stopwatch:
    """Wall and process-CPU seconds of a block; CPU time is less disturbed by other processes."""

    def __enter__(self) -> Stopwatch:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


@contextlib.contextmanager
def pinned_server(model: str, core: str = "0"):
    """A fresh `mileage serve` of `model` pinned to `core` with one torch thread, for as long as
    the block runs; yields the flags that point a `mileage train` at it."""
    from mileage.testing.servers import start_servers

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    (server,) = start_servers(model, 1, env=env, cores=core)
    try:
        yield ["--rollout-engine", "sglang", "--rollout-url", server.url]
    finally:
        server.stop()


def served_model(extra: list[str]) -> str:
    """The model a benchmark's server serves: the run's --hf-checkpoint, else the built-in."""
    if "--hf-checkpoint" in extra:
        return extra[extra.index("--hf-checkpoint") + 1]
    from mileage.rollout.builtin_model import ensure_builtin_model

    return str(ensure_builtin_model("addition", log=lambda *_: None))
