"""QEMU restore by mapping guest RAM vs by streaming it (issue 12), under TCG on this host.

    .venv/bin/python -m bench --only microvm --runs 5

Runtime level (no server: the figures are the runtime's own phases, as its log line reports
them): per guest size (256 MiB, 1 GiB, 2 GiB) and RAM mode a VM is booted, half its RAM filled
by a guest process with non-zero data, snapshotted (the VM keeps running) and restored ``runs``
times (each restore killed again):

* ``stream``: anonymous RAM migrated to a file and read back (the path before issue 12,
  ``FORKYARD_QEMU__MEMORY=stream``);
* ``file``: RAM in a reflink-pool file, snapshot = reflink clone + device state, restore maps a
  clone; ``file_spare``: the same with a pre-started QEMU (``FORKYARD_QEMU__PRESPAWN``).

``restore_*`` is the runtime's restore until envd answers, ``first_command_*`` adds the first
command through envd; ``phases`` are medians of the runtime's phase profile. ``fork4`` is one
snapshot (pause of the parent, as the orchestrator's fork) plus 4 restores at once until all
answer. ``snapshot_disk_mib`` is what the pool's file system allocates for the snapshot's RAM
(reflink: shared with the VM's file) and ``ram_copy_ms`` what copying that RAM file (instead of
reflinking it) costs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import stats
from forkyard.config import QemuSettings, Settings
from forkyard.runtime.qemu.runtime import QemuRuntime
from forkyard.runtime.qemu.spares import Shape
from forkyard.storage.reflink import ReflinkPool, disk_usage_bytes
from forkyard.storage.templates import load_template
from forkyard.types import SandboxInstance, SandboxSpec, SnapshotRef, TemplateImage

SIZES_MB = (256, 1024, 2048)
MAX_RESTORES = 5
FORK_COUNT = 4
PHASE_LINE = re.compile(r"qemu (\S+): (\w+) in (\d+) ms \(([^)]*)\)")
TEMPLATES = Path("/var/lib/forkyard/templates")


class PhaseLog(logging.Handler):
    """The runtime's phase line per sandbox and operation."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[tuple[str, str], dict[str, int]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = PHASE_LINE.search(record.getMessage())
        if match:
            sandbox, op, total, parts = match.groups()
            phases = {k: int(v) for k, v in (p.rsplit(" ", 1) for p in parts.split(", ") if " " in p)}
            self.lines[(sandbox, op)] = {"total": int(total), **phases}


def _envd_run(instance: SandboxInstance, command: str, timeout: float = 300) -> str:
    from e2b import Sandbox
    from e2b.connection_config import ConnectionConfig
    from packaging.version import Version

    headers = {"E2b-Sandbox-Id": instance.sandbox_id, "E2b-Sandbox-Port": "49983"}
    config = ConnectionConfig(
        sandbox_url=instance.envd_url, api_key="e2b_bench", extra_sandbox_headers=headers
    )
    sbx = Sandbox(  # type: ignore[call-arg]  # the SDK's own constructor kwargs (as the tests)
        sandbox_id=instance.sandbox_id,
        sandbox_domain=None,
        envd_version=Version("0.6.4"),
        envd_access_token=None,
        connection_config=config,
    )
    return str(sbx.commands.run(command, timeout=timeout, request_timeout=timeout).stdout)


def _fill_command(mib: int) -> str:
    # A process holding `mib` MiB of non-zero pages (zero pages cost a migration stream nothing).
    return (
        "nohup python3 -c 'import os,time; b=bytearray(os.urandom(1<<20))*"
        f'{mib}; open("/tmp/filled","w").close(); time.sleep(1e9)\' >/dev/null 2>&1 & '
        "while [ ! -e /tmp/filled ]; do sleep 0.2; done"
    )


def _median_phases(lines: list[dict[str, int]]) -> dict[str, float]:
    keys = {k for line in lines for k in line}
    return {k: statistics.median(line.get(k, 0) for line in lines) for k in sorted(keys)}


class Bench:
    def __init__(self, data: Path, runs: int) -> None:
        self.data = data
        self.restores = max(1, min(runs, MAX_RESTORES))
        self.log = PhaseLog()
        for name in ("forkyard.runtime.microvm.runtime", "forkyard.runtime.qemu.runtime"):
            logging.getLogger(name).addHandler(self.log)
            logging.getLogger(name).setLevel(logging.INFO)
        self._n = 0

    def runtime(self, memory: str, prespawn: int) -> QemuRuntime:
        qemu = QemuSettings(memory=memory, prespawn=prespawn)  # type: ignore[arg-type]
        return QemuRuntime(Settings(data_dir=self.data, templates_path=TEMPLATES, qemu=qemu))

    def new_id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n:04d}"

    async def boot_filled(self, runtime: QemuRuntime, tmpl: TemplateImage) -> SandboxInstance:
        vm = await runtime.create(SandboxSpec(sandbox_id=self.new_id("b"), template=tmpl))
        await asyncio.to_thread(_envd_run, vm, _fill_command(tmpl.memory_mb // 2))
        return vm

    async def snapshot(self, runtime: QemuRuntime, vm: SandboxInstance, *, stop: bool) -> SnapshotRef:
        snap = SnapshotRef(self.new_id("s"), self.data / "snapshots" / self.new_id("d"))
        await runtime.snapshot(vm, snap, stop=stop)
        return snap

    async def restore_once(
        self, runtime: QemuRuntime, tmpl: TemplateImage, snap: SnapshotRef
    ) -> dict[str, Any]:
        spec = SandboxSpec(sandbox_id=self.new_id("r"), template=tmpl)
        start = time.perf_counter()
        child = await runtime.restore(spec, snap)
        restored = time.perf_counter() - start
        await asyncio.to_thread(_envd_run, child, "true")
        first = time.perf_counter() - start
        await runtime.kill(child)
        return {
            "restore": restored,
            "first": first,
            "phases": self.log.lines.get((spec.sandbox_id, "restore"), {}),
        }

    async def measure_mode(self, tmpl: TemplateImage, memory: str) -> dict[str, Any]:
        plain = self.runtime(memory, prespawn=0)
        vm = await self.boot_filled(plain, tmpl)
        pool_root = ReflinkPool(self.data).root
        used = disk_usage_bytes(pool_root)
        snap = await self.snapshot(plain, vm, stop=False)
        out: dict[str, Any] = {
            "snapshot": self.log.lines.get((vm.sandbox_id, "snapshot"), {}),
            "snapshot_disk_mib": round((disk_usage_bytes(pool_root) - used) / (1 << 20), 1),
        }
        await plain.kill(vm)
        variants = [("", plain)]
        if memory == "file":
            variants.append(("_spare", self.runtime(memory, prespawn=1)))
        for suffix, runtime in variants:
            samples = []
            for _ in range(self.restores):
                if runtime.spares.size:
                    await self._spare_ready(runtime, tmpl)
                samples.append(await self.restore_once(runtime, tmpl, snap))
            await runtime.stop_prestarted()
            out[f"restore{suffix}"] = stats([s["restore"] for s in samples])
            out[f"first_command{suffix}"] = stats([s["first"] for s in samples])
            out[f"phases{suffix}"] = _median_phases([s["phases"] for s in samples])
        if memory == "file":
            out["ram_copy_ms"] = await asyncio.to_thread(self._copy_ram_ms, snap)
        else:
            out["state_file_mib"] = round((snap.path / "memory.bin").stat().st_size / (1 << 20), 1)
        return out

    async def _spare_ready(self, runtime: QemuRuntime, tmpl: TemplateImage, limit_s: float = 60) -> None:
        shape = Shape(await runtime._images.get(runtime.settings, tmpl), tmpl.vcpus, tmpl.memory_mb)
        runtime.spares.want(shape)
        await runtime.spares.wait_ready(shape, 1, limit_s)

    def _copy_ram_ms(self, snap: SnapshotRef) -> float:
        """What the restore's reflink clone would cost as a copy (a file system without reflink)."""
        src = (snap.path / "memory.ram").resolve()
        dst = self.data / "ram-copy.bin"  # outside the pool: the data dir's own file system
        start = time.perf_counter()
        with open(src, "rb") as s, open(dst, "wb") as d:
            shutil.copyfileobj(s, d, 8 << 20)
        elapsed = time.perf_counter() - start
        dst.unlink()
        return round(elapsed * 1000, 1)

    async def fork(self, tmpl: TemplateImage, memory: str) -> dict[str, Any]:
        runtime = self.runtime(memory, prespawn=FORK_COUNT if memory == "file" else 0)
        vm = await self.boot_filled(runtime, tmpl)
        if runtime.spares.size:
            shape = Shape(await runtime._images.get(runtime.settings, tmpl), tmpl.vcpus, tmpl.memory_mb)
            await runtime.spares.wait_ready(shape, FORK_COUNT, 120)
        start = time.perf_counter()
        snap = await self.snapshot(runtime, vm, stop=True)
        specs = [SandboxSpec(sandbox_id=self.new_id("f"), template=tmpl) for _ in range(FORK_COUNT)]
        kids = await asyncio.gather(*(runtime.restore(spec, snap) for spec in specs))
        await asyncio.gather(*(asyncio.to_thread(_envd_run, kid, "true") for kid in kids))
        elapsed = time.perf_counter() - start
        for kid in kids:
            await runtime.kill(kid)
        await runtime.kill(vm)
        await runtime.stop_prestarted()
        restores = [self.log.lines.get((s.sandbox_id, "restore"), {}) for s in specs]
        return {"fork4_to_all_answering": stats([elapsed]), "fork4_restore_phases": _median_phases(restores)}


def run(runs: int) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="forkyard-bench-microvm-", dir="/var/tmp"))
    bench = Bench(data, runs)
    base = load_template("base", Settings(data_dir=data, templates_path=TEMPLATES))
    result: dict[str, Any] = {"restores_per_size": bench.restores, "accel": bench.runtime("file", 0).accel}
    try:
        for size in SIZES_MB:
            tmpl = dataclasses.replace(base, memory_mb=size)
            for memory in ("stream", "file"):
                result[f"qemu_{memory}_{size}mib"] = asyncio.run(bench.measure_mode(tmpl, memory))
        for memory in ("stream", "file"):
            result[f"qemu_{memory}_fork"] = asyncio.run(
                bench.fork(dataclasses.replace(base, memory_mb=256), memory)
            )
    finally:
        asyncio.run(bench.runtime("file", 0).cleanup_orphans(set()))
        ReflinkPool(data).destroy()
        shutil.rmtree(data, ignore_errors=True)
    return result


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 3), indent=2))
