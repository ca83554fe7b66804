"""The per-child CPU budget of a fork (issue 26, part 3): host CPU seconds per forked child by
component, and the processes started per child, on a real server with production settings.

CPU time, not wall time: the machine is shared, and a process's CPU seconds do not depend on who
else runs. The server runs with ``bench/cpu_account`` on its ``PYTHONPATH`` (a ``sitecustomize``
that records every process the server starts and reaps it with ``wait4``: per kind of command,
processes started and their CPU seconds, children included; the server's own CPU). The children's
sentries, gofers and everything in their sandboxes are read from their cgroups (``cpuacct``) just
before their kill. Each round: a fork of :data:`COUNT` children of one prepared parent through
the streaming fork (``forkyard_rl.fork_stream``), up to the last child answering (``/init`` done:
its line arrived), then the kill of all of them and the background release of their network,
disks and cgroups (:data:`SETTLE_SECONDS`).

    .venv/bin/python -m bench --only fork_cpu
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO, ServerProcess, serve
from forkyard_rl import Connection, fork_stream
from forkyard_rl.actions import bounded
from forkyard_rl.group import kill_quietly

COUNT = 16
LIFETIME = 600
SETTLE_SECONDS = 5.0
ACCOUNTING = REPO / "bench" / "cpu_account"
CPUACCT = Path("/sys/fs/cgroup/cpuacct/forkyard")
PREPARE = (
    "mkdir -p /home/user/work && cd /home/user/work && head -c 8388608 /dev/urandom > data.bin && "
    "python3 -m compileall -q /usr/lib/python3*/json >/dev/null 2>&1; (nohup sleep 3600 >/dev/null 2>&1 &)"
)


#: The parent's processes and threads, as the guest sees them.
GUEST_TASKS = (
    "ls /proc | grep -c '^[0-9]'; grep -h ^Threads /proc/[0-9]*/status | awk '{s += $2} END {print s}'"
)


def _prepare() -> str:
    """The parent's preparation (``FORKYARD_BENCH_FORK_CPU_PREPARE`` replaces it: restore cost against
    what the sandbox holds)."""
    return os.environ.get("FORKYARD_BENCH_FORK_CPU_PREPARE") or PREPARE


def _parent_size(sandbox_id: str) -> dict[str, int]:
    """What the parent holds at its fork: memory (cgroup), host processes and threads of its sandbox."""
    size = {}
    for key, path in (
        ("memory_bytes", Path("/sys/fs/cgroup/memory/forkyard") / sandbox_id / "memory.usage_in_bytes"),
        ("host_processes", CPUACCT / sandbox_id / "cgroup.procs"),
        ("host_threads", CPUACCT / sandbox_id / "tasks"),
    ):
        try:
            text = path.read_text()
        except OSError:
            continue
        size[key] = int(text) if key == "memory_bytes" else len(text.split())
    return size


def _runs() -> int:
    return max(1, int(os.environ.get("FORKYARD_BENCH_FORK_CPU_RUNS", "3")))


def _accounts(server: ServerProcess, out: Path) -> dict[str, Any]:
    """The server's accounting now (it writes the file on SIGUSR2)."""
    out.unlink(missing_ok=True)
    server.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while not out.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the server wrote no CPU accounting (is bench/cpu_account on its path?)")
        time.sleep(0.02)
    return dict(json.loads(out.read_text()))


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for kind, now in after["children"].items():
        then = before["children"].get(kind, {"started": 0, "reaped": 0, "cpu_s": 0.0})
        started = now["started"] - then["started"]
        if started or now["cpu_s"] - then["cpu_s"] > 0:
            kinds[kind] = {"started": started, "cpu_s": now["cpu_s"] - then["cpu_s"]}
    return {"server_cpu_s": after["server_cpu_s"] - before["server_cpu_s"], "children": kinds}


def _sandbox_cpu(sandbox_id: str) -> float:
    try:
        return int((CPUACCT / sandbox_id / "cpuacct.usage").read_text()) / 1e9
    except OSError:
        return float("nan")


async def _round(server: ServerProcess, parent: Any, out: Path, profile: bool) -> dict[str, Any]:
    if profile:  # FORKYARD_BENCH_CPU_PROFILE: a cProfile of the server's event loop over this round
        server.proc.send_signal(signal.SIGUSR1)
    before = _accounts(server, out)
    start = time.perf_counter()
    children = []
    first = 0.0
    async for started in fork_stream(parent, COUNT, lifetime=LIFETIME):
        if started.sandbox is None:
            raise RuntimeError(f"a child failed: {started.error}")
        children.append(started.sandbox)
        first = first or time.perf_counter() - start
    last = time.perf_counter() - start
    up = _accounts(server, out)
    sandboxes = [_sandbox_cpu(c.sandbox_id) for c in children]
    await bounded(COUNT, [lambda c=c: kill_quietly(c) for c in children])
    await asyncio.sleep(SETTLE_SECONDS)
    down = _accounts(server, out)
    if profile:
        server.proc.send_signal(signal.SIGUSR1)
    return {
        "first_s": first,
        "all_s": last,
        "up": _delta(before, up),
        "down": _delta(up, down),
        "sandboxes_cpu_s": sandboxes,
    }


def _per_child(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean per child over the rounds: CPU ms and processes by component and phase."""
    n = COUNT * len(rounds)
    table: dict[str, dict[str, float]] = {}

    def add(name: str, cpu_s: float, started: int) -> None:
        row = table.setdefault(name, {"cpu_ms": 0.0, "processes": 0.0})
        row["cpu_ms"] += cpu_s * 1000 / n
        row["processes"] += started / n

    for r in rounds:
        add("sandbox (sentry restore, gofer, envd /init)", sum(r["sandboxes_cpu_s"]), 0)
        for phase in ("up", "down"):
            add(f"server ({phase})", r[phase]["server_cpu_s"], 0)
            for kind, v in r[phase]["children"].items():
                add(f"{kind} ({phase})", v["cpu_s"], v["started"])
    rounded = {
        k: {"cpu_ms": round(v["cpu_ms"], 1), "processes": round(v["processes"], 2)} for k, v in table.items()
    }
    total = {
        "cpu_ms": round(sum(v["cpu_ms"] for v in table.values()), 1),
        "processes": round(sum(v["processes"] for v in table.values()), 2),
    }
    return {"components": dict(sorted(rounded.items(), key=lambda kv: -kv[1]["cpu_ms"])), "total": total}


async def _measure(server: ServerProcess, out: Path, runs: int) -> dict[str, Any]:
    from e2b import AsyncSandbox

    conn = Connection(api_key=server.api_key, api_url=server.url, sandbox_url=server.url, request_timeout=300)
    parent = await AsyncSandbox.create("base", timeout=3600, **conn.opts())
    try:
        await parent.commands.run(_prepare(), timeout=300)
        await asyncio.sleep(SETTLE_SECONDS)
        guest = await parent.commands.run(GUEST_TASKS)
        size = {**_parent_size(parent.sandbox_id), "guest": guest.stdout.split()}
        rounds = []
        for i in range(runs):
            profile = bool(os.environ.get("FORKYARD_BENCH_CPU_PROFILE")) and i == runs - 1
            rounds.append(await _round(server, parent, out, profile))
            print(f"fork_cpu bench: round {i}: all {rounds[-1]['all_s']:.2f} s", flush=True)
    finally:
        await kill_quietly(parent)
    return {
        "count": COUNT,
        "rounds": runs,
        "prepare": _prepare(),
        "parent": size,
        "per_child": _per_child(rounds),
        "first_answering_s": [round(r["first_s"], 3) for r in rounds],
        "all_answering_s": [round(r["all_s"], 3) for r in rounds],
        "raw": rounds,
    }


def run(runs: int = 0) -> dict[str, Any]:
    out = Path(f"/tmp/forkyard-cpu-account-{os.getpid()}.json")
    env = {
        "FORKYARD_BENCH_CPU_ACCOUNT": str(out),
        "FORKYARD_BENCH_CPU_PROFILE": os.environ.get("FORKYARD_BENCH_CPU_PROFILE", ""),
        "PYTHONPATH": str(ACCOUNTING),
    }
    try:
        with serve(extra_env=env) as server:
            return asyncio.run(_measure(server, out, _runs()))
    finally:
        out.unlink(missing_ok=True)


def main() -> None:
    from bench.harness import write_result

    result = run()
    name = os.environ.get("FORKYARD_BENCH_FORK_CPU_NAME", "fork_cpu")
    print(write_result(name, result))
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=2))


if __name__ == "__main__":
    main()
