"""Density: the host memory of one idle sandbox while running, frozen and on disk, and the disk
an on-disk (paused) sandbox takes.

    .venv/bin/python -m bench --only density --runs 20     # or: python -m bench.density 20

One server of its own with ``FORKYARD_PAUSE_DISK_AFTER_SECONDS`` short (:data:`DISK_AFTER`), so
the real tiering path is measured: ``min(runs, MAX_SANDBOXES)`` idle sandboxes are created from the
template (one command each, then left alone) and measured; all are paused (frozen in place) and
measured again at once; then the server moves them to disk by itself and they are measured a
third time. Per sandbox and state:

* **PSS** (the figure density is judged on): the sum of ``Pss`` in ``/proc/<pid>/smaps_rollup``
  over the sandbox's host processes: every process in its memory cgroup
  (``/sys/fs/cgroup/memory/forkyard/<id>``: runsc-gofer, runsc-sandbox (the sentry, where envd
  and the sandbox's processes live) and the ptrace stubs), every process whose command line names
  the sandbox id, and their children. Pages shared between sandboxes (the runsc binary) are split
  between them, so PSS adds up to what the node spends.
* **RSS**: the same processes' ``Rss`` (shared pages counted in full in every sandbox).
* **cgroup**: ``memory.usage_in_bytes`` of the sandbox's memory cgroup (pages charged to it:
  the sandbox's memory file and page cache, not the runsc binary).
* on disk: the pause snapshot's bytes under ``<data_dir>/snapshots/<snapshot_id>/`` (allocated
  blocks; the memory image), the disk layers its root stands on (``disk-layers/``, shared with
  its snapshots' other users) and its own directory (``sandboxes/<id>/``: upper layer, logs).

Also: the node's ``MemAvailable`` drop per running sandbox (a cross-check of PSS), and how long
the server's moves to disk took (its ``paused sandbox moved to disk`` events).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ServerProcess, serve, stats, write_result
from bench.lifecycle import Pools, describe_runtime

MAX_SANDBOXES = 10
MIN_SANDBOXES = 3
#: Seconds a frozen sandbox stays in memory on the density server: time for the frozen
#: measurement of every sandbox, short enough not to keep the bench waiting.
DISK_AFTER = 10
#: Idle time before the running measurement (the first command's buffers settle).
IDLE_SECONDS = 3.0
TIER_WAIT_SECONDS = 300.0
MEMORY_CGROUP = Path("/sys/fs/cgroup/memory/forkyard")
MIB = 1 << 20
GIB = 1 << 30


# -- the host side of one sandbox -------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        text = _read(stat)
        if text:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses
            out[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    return out


def sandbox_pids(sandbox_id: str) -> set[int]:
    """The host processes of a sandbox: its memory cgroup's, those naming it, their children."""
    pids = {int(p) for p in _read(MEMORY_CGROUP / sandbox_id / "cgroup.procs").split()}
    needle = sandbox_id.encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle in cmdline.read_bytes():
                pids.add(int(cmdline.parent.name))
        except OSError:  # exited meanwhile
            continue
    parents = _parents()
    grew = True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in pids and pid not in pids}
        pids |= children
        grew = bool(children)
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


def _rollup(pid: int) -> dict[str, int]:
    """``Rss`` and ``Pss`` of a process in bytes (0 when it is gone)."""
    out = {"Rss": 0, "Pss": 0}
    for line in _read(Path(f"/proc/{pid}/smaps_rollup")).splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] = int(rest.split()[0]) * 1024
    return out


def host_memory(sandbox_id: str) -> dict[str, int]:
    """Bytes of host memory of a sandbox: PSS and RSS of its processes, its cgroup's usage."""
    pids = sandbox_pids(sandbox_id)
    rollups = [_rollup(pid) for pid in pids]
    usage = _read(MEMORY_CGROUP / sandbox_id / "memory.usage_in_bytes").strip()
    return {
        "pss": sum(r["Pss"] for r in rollups),
        "rss": sum(r["Rss"] for r in rollups),
        "cgroup": int(usage) if usage else 0,
        "processes": len(pids),
    }


def tree_bytes(root: Path) -> dict[str, int]:
    """Allocated and apparent bytes of the files under ``root`` (each inode once)."""
    seen: set[tuple[int, int]] = set()
    allocated = apparent = 0
    if not root.exists():
        return {"allocated": 0, "apparent": 0}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return {"allocated": allocated, "apparent": apparent}


def _mem_available() -> int:
    for line in _read(Path("/proc/meminfo")).splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def dist(values: list[float], scale: float = MIB) -> dict[str, float | int]:
    """n, p50 (median), max and mean of ``values`` in units of ``scale`` (MiB by default)."""
    if not values:
        return {"n": 0}
    scaled = [v / scale for v in values]
    return {
        "n": len(scaled),
        "p50": round(statistics.median(scaled), 2),
        "max": round(max(scaled), 2),
        "mean": round(statistics.fmean(scaled), 2),
    }


# -- the measurement ---------------------------------------------------------------------------


def _memory_state(ids: list[str]) -> dict[str, Any]:
    measured = [host_memory(sid) for sid in ids]
    return {
        "pss_mib": dist([m["pss"] for m in measured]),
        "rss_mib": dist([m["rss"] for m in measured]),
        "cgroup_mib": dist([m["cgroup"] for m in measured]),
        "processes": dist([m["processes"] for m in measured], scale=1),
    }


def _wait_tiers(pools: Pools, ids: list[str], tier: str) -> float:
    """Wait until every sandbox is in ``tier``; seconds waited."""
    start = time.monotonic()
    while any(pools.database.pause_tier(sid) != tier for sid in ids):
        if time.monotonic() - start > TIER_WAIT_SECONDS:
            tiers = {sid: pools.database.pause_tier(sid) for sid in ids}
            raise RuntimeError(f"sandboxes not all {tier} after {TIER_WAIT_SECONDS:.0f} s: {tiers}")
        time.sleep(0.2)
    return time.monotonic() - start


def _on_disk(server: ServerProcess, pools: Pools, ids: list[str]) -> dict[str, Any]:
    images, image_apparent, layers, own = [], [], [], []
    for sid in ids:
        rec = pools.database.sandbox(sid)
        snap = server.data_dir / "snapshots" / str(rec.get("pause_snapshot") or "-")
        image = tree_bytes(snap)
        images.append(image["allocated"])
        image_apparent.append(image["apparent"])
        sandbox_dir = server.data_dir / "sandboxes" / sid
        try:
            chain = json.loads((sandbox_dir / "layers.json").read_text())
        except (OSError, ValueError):
            chain = []
        layers.append(sum(tree_bytes(server.data_dir / "disk-layers" / lid)["allocated"] for lid in chain))
        own.append(tree_bytes(sandbox_dir)["allocated"])
    return {
        **_memory_state(ids),
        "memory_image_mib": dist(images),
        "memory_image_apparent_mib": dist(image_apparent),
        "disk_layers_mib": dist(layers),
        "sandbox_dir_mib": dist(own),
    }


def run(runs: int) -> dict[str, Any]:
    from e2b import Sandbox

    count = max(MIN_SANDBOXES, min(runs, MAX_SANDBOXES))
    env = {"FORKYARD_PAUSE_DISK_AFTER_SECONDS": str(DISK_AFTER)}
    errors: list[str] = []
    with serve(extra_env=env) as server:
        pools = Pools(server, env)
        pools.wait_template_pool()
        time.sleep(IDLE_SECONDS)
        available_before = _mem_available()
        sandboxes = []
        try:
            for _ in range(count):
                sbx = pools.create("base").sandbox
                sandboxes.append(sbx)
                pools.settle()
            ids = [s.sandbox_id for s in sandboxes]
            runtime = describe_runtime(ids[0])
            time.sleep(IDLE_SECONDS)
            drop = (available_before - _mem_available()) / count
            running = _memory_state(ids)

            for sbx in sandboxes:
                sbx.pause()
            frozen_ids = [sid for sid in ids if pools.database.pause_tier(sid) == "frozen"]
            frozen = _memory_state(frozen_ids)
            still = [sid for sid in frozen_ids if pools.database.pause_tier(sid) == "frozen"]
            if len(still) < count:
                errors.append(f"only {len(still)} of {count} sandboxes stayed frozen while measured")

            waited = _wait_tiers(pools, ids, "disk")
            time.sleep(1.0)  # the checkpoints' processes exit
            disk = _on_disk(server, pools, ids)
            moves = [
                float(fields["duration_ms"]) / 1000
                for sid, fields in pools.database.events("paused sandbox moved to disk")
                if sid in ids and "duration_ms" in fields
            ]
            # The on-disk sandboxes are whole: one comes back and answers.
            back = Sandbox.connect(ids[0], timeout=300, **server.sdk_opts)
            if back.commands.run("cat /etc/hostname").exit_code != 0:
                errors.append(f"{ids[0]} did not answer after its resume from disk")
        finally:
            for sbx in sandboxes:
                try:
                    sbx.kill()
                except Exception as exc:  # killed already, or the server will on exit
                    errors.append(f"kill {sbx.sandbox_id}: {exc}")
    errors.extend(pools.errors)
    per_gib = {
        f"{state}_{kind}": round(GIB / (float(data[f"{kind}_mib"]["p50"]) * MIB), 1)
        for state, data in (("running", running), ("frozen", frozen))
        for kind in ("pss", "cgroup")
        if data[f"{kind}_mib"].get("p50")
    }
    on_disk_mib = float(disk["memory_image_mib"].get("p50", 0))
    return {
        "sandboxes": count,
        "runtime": f"gvisor: {runtime}",
        "disk_after_seconds": DISK_AFTER,
        "running": running,
        "frozen": frozen,
        "disk": disk,
        "idle_sandboxes_per_gib": per_gib,
        "disk_mib_per_on_disk_sandbox": round(on_disk_mib, 2),
        "node_mem_available_drop_mib_per_running_sandbox": round(drop / MIB, 2),
        "on_disk_sandboxes_per_gib_of_disk": round(1024 / on_disk_mib, 1) if on_disk_mib else None,
        "frozen_when_measured": len(still),
        "move_to_disk": stats(moves),
        "seconds_until_all_on_disk": round(waited, 1),
        "errors": errors,
        "notes": "idle sandboxes of the base template, created "
        "through the warm pool, one `echo hi` each, then idle; p50 over the sandboxes. PSS: "
        "sum over the sandbox's host processes (memory cgroup, command lines naming its id, "
        "children); cgroup: memory.usage_in_bytes; on disk: the pause snapshot's allocated bytes "
        f"(memory image). Frozen -> disk by the server itself after {DISK_AFTER} s "
        "(FORKYARD_PAUSE_DISK_AFTER_SECONDS); move_to_disk: the server's own timing of each move. "
        "cgroup on disk: what stays charged to the sandbox's (empty) memory cgroup, page cache of "
        "the files it wrote (reclaimable; the cgroup goes with the kill).",
    }


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    result = run(runs)
    path = write_result("density", result)
    print(json.dumps({k: v for k, v in result.items() if k != "notes"}, indent=2), "\n->", path)


if __name__ == "__main__":
    main()
