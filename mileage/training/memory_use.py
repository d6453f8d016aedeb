"""What this process uses: the memory it may still take (the plan's "free"), and the peak of
each rollout, recorded in metrics.jsonl beside the plan's estimate (`mileage.training.memory`).
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

import torch

from mileage import ranks

GiB = 1 << 30


def available_memory(device: torch.device) -> int:
    """Bytes this rank may still use: free GPU memory, or on a CPU what the process holds now
    plus what the machine has available, capped by a cgroup limit when one is set."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    held = _rss_bytes() or 0
    free = _meminfo("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_room()
    free = free if limit is None else min(free, limit)
    # ranks on one machine share it: each gets its share of what is free
    return held + free // max(ranks.local_world_size(), 1)


def reset_peak(device: torch.device) -> None:
    """Start a new peak: the process's resident high-water mark (Linux) and, on CUDA, torch's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # the peak then is the process's lifetime one
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_record(device: torch.device, estimate_bytes: int | None) -> dict[str, float]:
    """metrics.jsonl's memory keys for the rollout since `reset_peak`: the largest over ranks
    of each rank's peak, in GiB, and the estimate beside it."""
    peaks = [_peak_rss_bytes()]
    if device.type == "cuda":
        peaks.append(torch.cuda.max_memory_allocated(device))
    worst = [max(column) for column in zip(*ranks.all_gather_object(peaks), strict=True)]
    record = {"mem_peak_gib": round(worst[0] / GiB, 3)}
    if device.type == "cuda":
        record["mem_cuda_peak_gib"] = round(worst[1] / GiB, 3)
    if estimate_bytes:
        record["mem_estimate_gib"] = round(estimate_bytes / GiB, 3)
    return record


def _proc_kib(path: str, key: str) -> int | None:
    """The `key: N kB` line of a /proc file (None where there is none: not Linux)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def _status_kib(key: str) -> int | None:
    return _proc_kib("/proc/self/status", key)


def _rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib << 10


def _peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:  # not Linux: the lifetime peak (KiB on Linux, bytes on macOS)
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib << 10


def _meminfo(key: str) -> int | None:
    kib = _proc_kib("/proc/meminfo", key)
    return None if kib is None else kib << 10


def _cgroup_room() -> int | None:
    """The cgroup's limit less its usage (v2, then v1); None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return max(int(limit) - usage, 0)
    return None
