"""Runtimes side by side: the node's default runtime (the lead's server) and QEMU (TCG here),
each through a real ``agentenv serve`` and the official e2b SDK: create, one command, kill.
Plus the QEMU runtime's snapshot (migration to file) and restore, and the reflink disk layers
(100 clones of a 1 GiB base, from :mod:`bench.reflink`).

    .venv/bin/python -m bench --only runtimes --runs 20

QEMU under TCG boots a kernel and a python envd on an emulated CPU (1-3 minutes each on this
2-core host), so it runs ``min(runs, QEMU_RUNS)`` times; the count is in the result.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from agentenv.storage.reflink import ReflinkPool
from bench import reflink
from bench.harness import serve, stats

QEMU_RUNS = 3


def _sdk_cycle(server_url: str, api_key: str, runs: int) -> dict[str, object]:
    from e2b import Sandbox

    create, command, kill = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        sbx = Sandbox.create(template="base", api_key=api_key, api_url=server_url, sandbox_url=server_url,
                             request_timeout=900, timeout=900)
        t1 = time.perf_counter()
        try:
            sbx.commands.run("echo ok", timeout=120, request_timeout=120)
            t2 = time.perf_counter()
        finally:
            sbx.kill(request_timeout=120)
        t3 = time.perf_counter()
        create.append(t1 - t0)
        command.append(t2 - t1)
        kill.append(t3 - t2)
    return {"create": stats(create), "command": stats(command), "kill": stats(kill)}


def _qemu_snapshot_restore(runs: int) -> dict[str, object]:
    """Runtime-level (no server): QEMU migration to a file and restore from it."""
    from agentenv.config import Settings
    from agentenv.runtime.base import SandboxSpec, SnapshotRef
    from agentenv.runtime.qemu.runtime import QemuRuntime
    from agentenv.storage.templates import load_template

    data = Path(tempfile.mkdtemp(prefix="aebq-", dir="/tmp"))
    settings = Settings(data_dir=data, templates_path=Path("/var/lib/agentenv/templates"))
    runtime = QemuRuntime(settings)
    template = load_template("base", settings)
    save, restore, sizes = [], [], []

    async def once(i: int) -> None:
        inst = await runtime.create(SandboxSpec(sandbox_id=f"bq{uuid.uuid4().hex[:8]}", template=template))
        try:
            snap = SnapshotRef(f"s{i}", data / "snapshots" / f"s{i}")
            t0 = time.perf_counter()
            await runtime.snapshot(inst, snap, stop=True)
            save.append(time.perf_counter() - t0)
            sizes.append((snap.path / "memory.bin").stat().st_size)
            t0 = time.perf_counter()
            spec = SandboxSpec(sandbox_id=f"bq{uuid.uuid4().hex[:8]}", template=template)
            restored = await runtime.restore(spec, snap)
            restore.append(time.perf_counter() - t0)
            await runtime.kill(restored)
        finally:
            await runtime.kill(inst)

    try:
        for i in range(runs):
            asyncio.run(once(i))
    finally:
        asyncio.run(runtime.cleanup_orphans(set()))
        ReflinkPool(data).destroy()
        shutil.rmtree(data, ignore_errors=True)
    return {"save": stats(save), "restore_to_envd": stats(restore),
            "memory_file_mib": round(sum(sizes) / max(1, len(sizes)) / (1 << 20), 1)}


def run(server_url: str, api_key: str, runs: int) -> dict[str, object]:
    result: dict[str, object] = {"reflink": reflink.run(runs, 100)}
    result["default_runtime"] = _sdk_cycle(server_url, api_key, runs)
    qemu_runs = min(runs, QEMU_RUNS)
    with serve(runtime="qemu") as qemu_server:
        try:
            result["qemu_tcg"] = _sdk_cycle(qemu_server.url, qemu_server.api_key, qemu_runs)
        finally:
            qemu_data = qemu_server.data_dir
    # The server's runtime loop-mounted a reflink pool in its data directory: release it.
    ReflinkPool(qemu_data).destroy()
    shutil.rmtree(qemu_data, ignore_errors=True)
    result["qemu_tcg_snapshot"] = _qemu_snapshot_restore(qemu_runs)
    result["qemu_runs"] = qemu_runs
    return result
