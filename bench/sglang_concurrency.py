"""Rollout throughput of the SGLang client against requests in flight per server.

    python bench/sglang_concurrency.py [--latency 0.2] [--servers 2] [--groups 64] [--repeats 3]

A real SGLang server batches the requests it has continuously, so one request takes about the
same time whether it is alone or one of many: that is what `FakeSGLang` models (each request
sleeps `latency` seconds, times a factor in [0.5, 1.5) drawn from its seed, concurrently with
the others, and answers tokens drawn from each row's seed). What the bench measures is then the
client alone: how many requests it keeps in flight, at what cost per request, and that the
samples are the same at every `--sglang-server-concurrency`. It needs no model and little CPU.
"""

from __future__ import annotations

import argparse
import time

import _common

from mileage.rollout.engine import SamplingParams
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.engines.sglang import SGLangEngine
from mileage.testing.servers import FakeSGLang


def one_rollout(urls: list[str], concurrency: int, groups: int, group_size: int):
    engine = SGLangEngine(urls, 50, 120.0, 2, 120.0, None, concurrency=concurrency,
                          log=lambda line: None)  # fmt: skip
    engine.weight_version = 1
    prompts = [[1 + g % 40, 2, 3, 4] for g in range(groups) for _ in range(group_size)]
    started = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(8, 1.0, 1.0), SamplingSeed(1234, 0), group_size)
    return time.perf_counter() - started, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per request (mean)")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=64, help="requests per rollout")
    parser.add_argument("--group-size", type=int, default=8, help="samples per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    fakes = [FakeSGLang(latency=args.latency) for _ in range(args.servers)]
    for fake in fakes:
        fake.weight_version = "1"
    urls = [f.url for f in fakes]
    load_before = _common.load_average()
    rows, reference = [], None
    try:
        for concurrency in args.concurrency:
            times = []
            for _ in range(args.repeats):
                for fake in fakes:
                    fake.max_in_flight = 0
                seconds, done = one_rollout(urls, concurrency, args.groups, args.group_size)
                times.append(seconds)
                reference = reference or done
                if done != reference:
                    raise SystemExit(f"concurrency {concurrency} drew other samples")
            wall = _common.median(times)
            rows.append({
                "concurrency": concurrency,
                "max_in_flight": max(f.max_in_flight for f in fakes),
                "rollout_s": wall,
                "range_s": _common.spread(times),
                "samples_per_s": args.groups * args.group_size / wall,
                "speedup": None,
            })  # fmt: skip
    finally:
        for fake in fakes:
            fake.stop()
    for row in rows:
        row["speedup"] = rows[0]["rollout_s"] / row["rollout_s"]
    table = _common.print_table(rows, [
        ("concurrency", "--sglang-server-concurrency"),
        ("max_in_flight", "max in flight per server"),
        ("rollout_s", "rollout s (median)"),
        ("range_s", "range s"),
        ("samples_per_s", "samples/s"),
        ("speedup", "speed-up vs 1"),
    ])  # fmt: skip
    print("samples identical at every concurrency: yes")
    _common.write_results(
        "sglang_concurrency",
        {
            "machine": _common.machine_info(1),
            "load_before": load_before,
            "load_after": _common.load_average(),
            "args": vars(args),
            "rows": rows,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
