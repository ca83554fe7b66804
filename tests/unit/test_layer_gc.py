"""Disk-layer garbage collection of the gVisor runtime, without runsc: layer dirs, snapshot
``meta.json`` files and sandbox ``layers.json`` files are what the collection reads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from forkyard.config import Settings
from forkyard.runtime.gvisor.runtime import GvisorRuntime
from forkyard.types import SnapshotRef


def make_layer(runtime: GvisorRuntime, tmp: Path, name: str) -> str:
    upper = runtime.settings.data_dir / f"upper-{name}"
    upper.mkdir(parents=True)
    (upper / name).write_text(name)
    return runtime.disks.layers.adopt(upper)


def write_snapshot(tmp: Path, snapshot_id: str, layers: list[str]) -> SnapshotRef:
    path = tmp / "snapshots" / snapshot_id
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"layers": layers}))
    return SnapshotRef(snapshot_id=snapshot_id, path=path)


def write_sandbox(runtime: GvisorRuntime, sandbox_id: str, layers: list[str]) -> Path:
    paths = runtime.paths(sandbox_id)
    paths.root.mkdir(parents=True)
    paths.layers_file.write_text(json.dumps(layers))
    return paths.root


async def test_layers_live_while_a_snapshot_or_sandbox_names_them(tmp_path: Path) -> None:
    runtime = GvisorRuntime(Settings(data_dir=tmp_path / "data"))
    base, mid, top, loose = (make_layer(runtime, tmp_path, n) for n in ("base", "mid", "top", "loose"))
    snap = write_snapshot(tmp_path, "snap1", [mid, base])
    write_sandbox(runtime, "sbx1", [top, mid, base])

    async def live() -> list[SnapshotRef]:
        return [snap]

    assert await runtime.collect_garbage(live) == [loose]
    assert runtime.disks.layers.ids() == {base, mid, top}
    # The sandbox goes: only the snapshot's chain stays.
    (runtime.paths("sbx1").layers_file).unlink()
    assert await runtime.collect_garbage(live) == [top]
    assert runtime.disks.layers.ids() == {base, mid}


async def test_a_snapshot_committed_while_a_collection_waits_is_not_missed(tmp_path: Path) -> None:
    """The collection lists live snapshots under the layer lock, not before it."""
    runtime = GvisorRuntime(Settings(data_dir=tmp_path / "data"))
    layer = make_layer(runtime, tmp_path, "written")
    sandbox_dir = write_sandbox(runtime, "source", [layer])
    committed: list[SnapshotRef] = []

    async def live() -> list[SnapshotRef]:
        return list(committed)

    async with runtime.disks.lock:  # e.g. a restore mounting a chain
        collection = asyncio.create_task(runtime.collect_garbage(live))
        await asyncio.sleep(0.05)
        # Meanwhile the source's snapshot is committed and the source sandbox is killed.
        committed.append(write_snapshot(tmp_path, "snap2", [layer]))
        (sandbox_dir / "layers.json").unlink()
    assert await collection == []
    assert runtime.disks.layers.exists(layer)


def test_disk_used_counts_the_layers_under_the_upper(tmp_path: Path) -> None:
    """A snapshot seals what a sandbox wrote into a layer: it still counts as the sandbox's."""
    runtime = GvisorRuntime(Settings(data_dir=tmp_path / "data"))
    upper = runtime.settings.data_dir / "upper-big"
    upper.mkdir(parents=True)
    (upper / "big").write_bytes(b"x" * (1 << 20))
    layer = runtime.disks.layers.adopt(upper)
    write_sandbox(runtime, "sbx", [layer])
    upper_dir = runtime.paths("sbx").upper  # on the sandbox's disk (not mounted here)
    upper_dir.mkdir(parents=True)
    (upper_dir / "small").write_bytes(b"y" * 4096)
    assert runtime.disks.used_bytes(runtime.paths("sbx")) >= (1 << 20) + 4096
