"""``GET /metrics`` (envd.yaml ``Metrics``): CPU, memory and disk of the sandbox, from /proc and statvfs."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies from the first line of /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total


class CpuSampler:
    """CPU use since the previous call (gopsutil's cpu.Percent(0), which Go's envd reports)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        try:
            self._last = _cpu_times()
        except OSError:
            self._last = (0, 0)

    def percent(self) -> float:
        with self._lock:
            try:
                busy, total = _cpu_times()
            except OSError:
                return 0.0
            last_busy, last_total = self._last
            self._last = (busy, total)
        if total <= last_total:
            return 0.0
        return round(100.0 * max(0, busy - last_busy) / (total - last_total), 2)


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[key] = int(parts[0]) * 1024
    return values


def collect(cpu: CpuSampler) -> dict[str, Any]:
    mem = _meminfo()
    total = mem.get("MemTotal", 0)
    available = mem.get("MemAvailable", mem.get("MemFree", 0))
    used = max(0, total - available)
    disk = os.statvfs("/")
    return {
        "ts": int(time.time()),
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": cpu.percent(),
        "mem_total": total,
        "mem_used": used,
        "mem_cache": mem.get("Cached", 0),
        "mem_total_mib": total // (1024 * 1024),
        "mem_used_mib": used // (1024 * 1024),
        "disk_used": (disk.f_blocks - disk.f_bfree) * disk.f_frsize,
        "disk_total": disk.f_blocks * disk.f_frsize,
    }
