"""A real Firecracker microVM: boot from the ``base`` template, snapshot, restore into a second
VM, both answer envd's /health; nothing of either left afterwards. Needs root, KVM that can boot
guests (vmx/svm, or PVM with FORKYARD_FIRECRACKER__PVM) and a firecracker binary; skips, printing
why, elsewhere (the API bodies and memory merging are unit-tested in
tests/unit/test_firecracker.py)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from forkyard.config import Settings
from forkyard.runtime.firecracker.runtime import FirecrackerRuntime
from forkyard.types import SandboxSpec, SnapshotRef, TemplateImage

pytestmark = [pytest.mark.requires_root("microVMs (netns, tap, /dev/kvm)"), pytest.mark.kvm]


def _real_firecracker_reason(runtime: FirecrackerRuntime) -> str | None:
    reason = runtime.probe()
    if reason is not None:
        return reason
    rootfs = Path("/var/lib/forkyard/templates/base/rootfs")
    if not rootfs.is_dir():
        return f"base template {rootfs} is missing (forkyard template build)"
    return None


async def test_real_firecracker_boot_snapshot_restore(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    runtime = FirecrackerRuntime(settings)
    reason = _real_firecracker_reason(runtime)
    if reason is not None:
        print(f"SKIP real Firecracker: {reason}")
        pytest.skip(reason)
    import httpx

    template = TemplateImage("base", Path("/var/lib/forkyard/templates/base/rootfs"), vcpus=1, memory_mb=512)
    suffix = uuid.uuid4().hex[:6]
    spec = SandboxSpec(f"fc{suffix}", template)
    instance = await runtime.create(spec)
    restored = None
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{instance.envd_url}/health")).status_code in (200, 204)
        snap = SnapshotRef(f"snap{suffix}", tmp_path / "snap")
        await runtime.snapshot(instance, snap, stop=False)
        restored = await runtime.restore(SandboxSpec(f"fr{suffix}", template), snap)
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{restored.envd_url}/health")).status_code in (200, 204)
    finally:
        await runtime.kill(instance)
        if restored is not None:
            await runtime.kill(restored)
    leftovers = [settings.data_dir / "sandboxes" / spec.sandbox_id, Path(f"/run/netns/ae-{spec.sandbox_id}")]
    assert not [p for p in leftovers if os.path.lexists(p)]  # noqa: ASYNC240 - test assertion
