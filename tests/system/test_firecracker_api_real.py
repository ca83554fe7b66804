"""Every request body the Firecracker runtime sends, against the real pinned Firecracker binary
(v1.12.1, :func:`tests.support.kvmhost.firecracker_binary`). The configuration requests need no
KVM: Firecracker parses and checks them before InstanceStart, so this runs on any host. Its API
structs reject unknown fields, which the published schema (tests/unit/test_firecracker.py) does not
show: this is the test that found ``free_page_reporting`` (v1.14+) and ``track_dirty_pages`` on
``/snapshot/load`` (v1.13+) being sent to v1.12."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkyard.config import FirecrackerSettings, Settings
from forkyard.runtime.firecracker import api
from forkyard.runtime.firecracker.runtime import FirecrackerRuntime, boot_requests, fc_paths, restore_requests
from forkyard.storage.images import GuestImages, GuestKernel
from tests.support.kvmhost import KvmHostUnavailable, firecracker_binary


@pytest.fixture(scope="module")
def binary() -> Path:
    try:
        return firecracker_binary()
    except (KvmHostUnavailable, OSError) as exc:
        print(f"SKIP the pinned firecracker binary: {exc}")
        pytest.skip(f"the pinned firecracker binary is not obtainable here: {exc}")


@pytest.fixture()
def vmm(binary: Path, tmp_path: Path) -> Iterator[httpx.Client]:
    sock = Path("/tmp") / f"fy-fcapi-{uuid.uuid4().hex[:8]}.sock"
    proc = subprocess.Popen([str(binary), "--api-sock", str(sock)], cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None, (
                "firecracker did not create its socket"
            )
            time.sleep(0.01)
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://localhost"
        ) as client:
            yield client
    finally:
        proc.kill()
        proc.wait()
        sock.unlink(missing_ok=True)


def _send(client: httpx.Client, request: api.ApiRequest) -> httpx.Response:
    return client.request(request.method, request.path, json=request.body)


def _images(tmp_path: Path) -> GuestImages:
    for name in ("vmlinux", "initramfs.cpio", "base.ext4", "envd.ext4", "upper.ext4"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    kernel = GuestKernel(tmp_path / "vmlinux", tmp_path / "initramfs.cpio", "6.1.0-test-cloud-amd64")
    return GuestImages(kernel, tmp_path / "base.ext4", tmp_path / "envd.ext4", tmp_path / "upper.ext4")


def _runtime(binary: Path, tmp_path: Path) -> FirecrackerRuntime:
    return FirecrackerRuntime(
        Settings(data_dir=tmp_path / "data", firecracker=FirecrackerSettings(firecracker_path=str(binary)))
    )


def test_boot_requests_are_accepted_by_the_real_binary(
    binary: Path, vmm: httpx.Client, tmp_path: Path
) -> None:
    runtime = _runtime(binary, tmp_path)
    assert runtime.api_level().version == (1, 12, 1)
    paths = fc_paths(runtime.settings, "sb-real")
    paths.root.mkdir(parents=True)
    paths.log.touch()
    paths.metrics.touch()
    (tmp_path / "upper.ext4").write_bytes(b"\0" * 4096)
    requests = boot_requests(
        _images(tmp_path),
        paths,
        vcpus=1,
        memory_mb=256,
        kernel=tmp_path / "vmlinux",
        boot_args="console=ttyS0",
        level=runtime.api_level(),
    )
    assert requests[-1].path == "/actions"
    for request in requests[:-1]:  # InstanceStart needs /dev/kvm
        response = _send(vmm, request)
        assert response.status_code == 204, f"{request.method} {request.path}: {response.text}"


@pytest.mark.parametrize("uffd", [False, True])
def test_snapshot_load_body_is_understood_by_the_real_binary(
    binary: Path, vmm: httpx.Client, tmp_path: Path, uffd: bool
) -> None:
    """No snapshot exists: the load must fail on the missing file, not on the body's fields."""
    runtime = _runtime(binary, tmp_path)
    paths = fc_paths(runtime.settings, "sb-load")
    load = restore_requests(paths, tmp_path / "no-snapshot", uffd=uffd, level=runtime.api_level())[-1]
    response = _send(vmm, load)
    assert response.status_code == 400
    fault = response.json()["fault_message"]
    assert "deserializ" not in fault and "unknown field" not in fault, fault
