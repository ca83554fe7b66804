"""The cgroups runsc puts a sandbox in (``forkyard/<sandbox_id>`` in every v1 hierarchy): where its
limits are set, its usage is read, and what a kill removes (runsc leaves them behind)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

CGROUP_PARENT = "forkyard"
CGROUP_V1_ROOT = Path("/sys/fs/cgroup")


#: cpu.shares of a sandbox in use (the kernel's default weight) and of one made ahead of demand
#: (a warm-pool sandbox or standby, from its restore until claimed). On a 2-core node a pool
#: refill's restore, started by a claim, otherwise took half the CPU from the claimed sandbox's
#: first commands; at weight 16 it yields to live sandboxes and still uses idle cores fully.
LIVE_CPU_SHARES = 1024
AHEAD_OF_DEMAND_CPU_SHARES = 16


def set_cpu_shares(sandbox_id: str, shares: int) -> None:
    """Set the sandbox's CPU weight (cgroup v1 ``cpu.shares``); no-op once its cgroup is gone."""
    with contextlib.suppress(FileNotFoundError):
        (_group("cpu", sandbox_id) / "cpu.shares").write_text(str(shares))


def cgroups_path(sandbox_id: str) -> str:
    """The OCI ``linux.cgroupsPath`` of the sandbox."""
    return f"/{CGROUP_PARENT}/{sandbox_id}"


def memory_used(sandbox_id: str) -> int:
    """Bytes of memory the sandbox uses (0 when its cgroup is gone)."""
    return _read_int(_group("memory", sandbox_id) / "memory.usage_in_bytes")


def cpu_seconds(sandbox_id: str) -> float:
    """CPU time the sandbox has used since it started."""
    return _read_int(_group("cpuacct", sandbox_id) / "cpuacct.usage") / 1e9


def oom_kills(sandbox_id: str) -> int:
    """How many processes of the sandbox the host OOM killer has killed (``oom_kill`` of the
    v1 memory controller's ``memory.oom_control``; 0 when the cgroup is gone)."""
    try:
        text = (_group("memory", sandbox_id) / "memory.oom_control").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


def processes(sandbox_id: str) -> list[int] | None:
    """PIDs of the sandbox's processes (sentry, stubs, gofer), None when its cgroup is not found."""
    for group in (_group("freezer", sandbox_id), CGROUP_V1_ROOT / CGROUP_PARENT / sandbox_id):
        try:
            return [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            continue
    return None


def mapped_inodes(sandbox_id: str) -> set[int] | None:
    """Inode numbers of the files a process of the sandbox has memory-mapped (gVisor maps a file
    the sandbox maps shared into its stub processes), None when that cannot be told. On any
    device: the maps name the root overlay's device with the upper file's inode, and a number
    that matches some other file only makes a caller cautious."""
    pids = processes(sandbox_id)
    if pids is None:
        return None
    inodes: set[int] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError:
            return None
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and fields[4] != "0":
                inodes.add(int(fields[4]))
    return inodes


def sandbox_ids() -> set[str]:
    """Ids of the sandboxes that have a cgroup (any hierarchy) under ``forkyard/``: a crash, or
    runsc itself, leaves empty ones behind that no other listing finds."""
    if not CGROUP_V1_ROOT.is_dir():
        return set()
    found: set[str] = set()
    for hierarchy in CGROUP_V1_ROOT.iterdir():
        parent = hierarchy / CGROUP_PARENT
        with contextlib.suppress(OSError):
            found |= {d.name for d in parent.iterdir() if d.is_dir()}
    return found


def existing(sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup directories that still exist."""
    if not CGROUP_V1_ROOT.is_dir():
        return []
    return [group for h in CGROUP_V1_ROOT.iterdir() if (group := _group(h.name, sandbox_id)).is_dir()]


def remove(sandbox_id: str, *, settle: float = 0.0) -> None:
    """rmdir the sandbox's cgroup in every hierarchy, deepest first; what cannot go (still in
    use) stays for the next kill or orphan clean-up. ``settle``: seconds to keep retrying
    while a cgroup is busy (a SIGKILLed task leaves its cgroup only once the kernel has
    released it, a little after its parent saw it exit: a kill that removed at once left
    empty cgroups behind)."""
    deadline = time.monotonic() + settle
    while True:
        for group in existing(sandbox_id):
            for sub in sorted(group.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if sub.is_dir():
                    with contextlib.suppress(OSError):
                        sub.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()
        if not existing(sandbox_id) or time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def _group(hierarchy: str, sandbox_id: str) -> Path:
    return CGROUP_V1_ROOT / hierarchy / CGROUP_PARENT / sandbox_id


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
