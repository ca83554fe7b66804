"""Firecracker's REST API over its Unix socket.

The request bodies are built by plain functions returning :class:`ApiRequest` (method, path,
body and the name of the schema definition in Firecracker's published ``firecracker.yaml``),
so that tests can check every body the runtime sends against that schema without a VMM.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from forkyard.errors import Failed
from forkyard.runtime.microvm.host import Alive

SnapshotType = Literal["Full", "Diff"]
MemoryBackendType = Literal["File", "Uffd"]


@dataclass(frozen=True)
class ApiLevel:
    """What one Firecracker release accepts where forkyard's request bodies depend on it: its API
    structs reject unknown fields, so a field newer than the binary fails the whole request."""

    version: tuple[int, int, int] = (1, 17, 0)

    @property
    def free_page_reporting(self) -> bool:
        """The balloon's ``free_page_reporting`` (v1.14 and newer)."""
        return self.version[:2] >= (1, 14)

    @property
    def load_dirty_pages_field(self) -> str:
        """``/snapshot/load``'s dirty-page tracking flag: ``track_dirty_pages`` from v1.13 (the old
        name is deprecated there), ``enable_diff_snapshots`` before."""
        return "track_dirty_pages" if self.version[:2] >= (1, 13) else "enable_diff_snapshots"


#: The newest release whose schema the bodies are checked against (tests/data/firecracker).
NEWEST = ApiLevel()


class FirecrackerApiError(Failed):
    """The VMM answered a request with an error, or its API socket did not answer."""


@dataclass(frozen=True)
class ApiRequest:
    method: Literal["GET", "PUT", "PATCH"]
    path: str
    body: dict[str, Any] | None
    #: Definition in firecracker.yaml that ``body`` must satisfy.
    schema: str | None


def logger(log_path: Path, level: str = "Info") -> ApiRequest:
    body = {"log_path": str(log_path), "level": level, "show_level": True, "show_log_origin": False}
    return ApiRequest("PUT", "/logger", body, "Logger")


def metrics(metrics_path: Path) -> ApiRequest:
    return ApiRequest("PUT", "/metrics", {"metrics_path": str(metrics_path)}, "Metrics")


def machine_config(vcpus: int, memory_mb: int, *, track_dirty_pages: bool = True) -> ApiRequest:
    # Firecracker accepts 1 or an even vCPU count only when SMT is on; with smt off any 1..32 works.
    body = {
        "vcpu_count": vcpus,
        "mem_size_mib": memory_mb,
        "smt": False,
        "track_dirty_pages": track_dirty_pages,
    }
    return ApiRequest("PUT", "/machine-config", body, "MachineConfiguration")


def boot_source(kernel: Path, initrd: Path, boot_args: str) -> ApiRequest:
    body = {"kernel_image_path": str(kernel), "initrd_path": str(initrd), "boot_args": boot_args}
    return ApiRequest("PUT", "/boot-source", body, "BootSource")


def drive(drive_id: str, path: str, *, read_only: bool) -> ApiRequest:
    """A virtio-blk drive. ``path`` may be relative to the VMM's cwd: snapshots record it
    verbatim, so each restored VM opens its own copy of the upper drive. The guest does not see
    ``drive_id``: Firecracker's virtio-blk serial is derived from the file (:func:`blk_serial`)."""
    body = {
        "drive_id": drive_id,
        "path_on_host": path,
        "is_root_device": False,
        "is_read_only": read_only,
        "cache_type": "Unsafe",
        "io_engine": "Sync",
    }
    return ApiRequest("PUT", f"/drives/{drive_id}", body, "Drive")


def blk_serial(path: Path) -> str:
    """The serial the guest reads from a Firecracker virtio-blk drive (VIRTIO_BLK_T_GET_ID):
    the file's device, rdev and inode numbers, concatenated in decimal, cut to 20 bytes (what
    Firecracker's ``build_device_id`` does, after kvmtool)."""
    st = os.stat(path)
    return f"{st.st_dev}{st.st_rdev}{st.st_ino}"[:20]


def network_interface(iface_id: str, tap: str, guest_mac: str) -> ApiRequest:
    body = {"iface_id": iface_id, "host_dev_name": tap, "guest_mac": guest_mac}
    return ApiRequest("PUT", f"/network-interfaces/{iface_id}", body, "NetworkInterface")


def vsock(uds_path: Path, guest_cid: int = 3) -> ApiRequest:
    return ApiRequest("PUT", "/vsock", {"guest_cid": guest_cid, "uds_path": str(uds_path)}, "Vsock")


def balloon(amount_mib: int = 0, *, stats_interval_s: int = 1, level: ApiLevel = NEWEST) -> ApiRequest:
    """Free page reporting hands pages the guest frees back to the host (releases that have it);
    deflate-on-OOM lets the guest take ballooned memory back rather than OOM-kill a sandbox
    process."""
    body: dict[str, Any] = {
        "amount_mib": amount_mib,
        "deflate_on_oom": True,
        "stats_polling_interval_s": stats_interval_s,
    }
    if level.free_page_reporting:
        body["free_page_reporting"] = True
    return ApiRequest("PUT", "/balloon", body, "Balloon")


def balloon_update(amount_mib: int) -> ApiRequest:
    return ApiRequest("PATCH", "/balloon", {"amount_mib": amount_mib}, "BalloonUpdate")


def balloon_statistics() -> ApiRequest:
    """The balloon's target and actual size (``target_mib``, ``actual_mib``) and the guest's last
    memory report (``available_memory``, ``free_memory``, ... in bytes; absent until the guest's
    driver has sent one: stats are polled every ``stats_polling_interval_s``)."""
    return ApiRequest("GET", "/balloon/statistics", None, None)


def instance_start() -> ApiRequest:
    return ApiRequest("PUT", "/actions", {"action_type": "InstanceStart"}, "InstanceActionInfo")


def vm_state(state: Literal["Paused", "Resumed"]) -> ApiRequest:
    return ApiRequest("PATCH", "/vm", {"state": state}, "Vm")


def snapshot_create(snapshot_path: Path, mem_file_path: Path, snapshot_type: SnapshotType) -> ApiRequest:
    body = {
        "snapshot_path": str(snapshot_path),
        "mem_file_path": str(mem_file_path),
        "snapshot_type": snapshot_type,
    }
    return ApiRequest("PUT", "/snapshot/create", body, "SnapshotCreateParams")


def snapshot_load(
    snapshot_path: Path,
    backend_path: Path,
    *,
    backend_type: MemoryBackendType = "File",
    vsock_uds: Path | None = None,
    resume: bool = True,
    level: ApiLevel = NEWEST,
) -> ApiRequest:
    """Load a snapshot. With the ``File`` backend Firecracker maps the memory file MAP_PRIVATE:
    every VM restored from one snapshot shares its page-cache pages until it writes to them."""
    body: dict[str, Any] = {
        "snapshot_path": str(snapshot_path),
        "mem_backend": {"backend_type": backend_type, "backend_path": str(backend_path)},
        level.load_dirty_pages_field: True,
        "resume_vm": resume,
    }
    if vsock_uds is not None:
        body["vsock_override"] = {"uds_path": str(vsock_uds)}
    return ApiRequest("PUT", "/snapshot/load", body, "SnapshotLoadParams")


def describe_instance() -> ApiRequest:
    return ApiRequest("GET", "/", None, None)


class FirecrackerClient:
    """Async client of one Firecracker process's API socket."""

    def __init__(self, socket_path: Path, timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
            base_url="http://localhost",
            timeout=timeout,
        )

    async def wait_ready(self, within: float, alive: Alive | None = None) -> None:
        """Wait until the API socket answers (the VMM creates it shortly after exec)."""
        deadline = time.monotonic() + within
        while True:
            if self.socket_path.exists():
                try:
                    await self.send(describe_instance())
                    return
                except (httpx.HTTPError, FirecrackerApiError):
                    pass
            if alive is not None and not await alive():
                raise FirecrackerApiError("firecracker exited before its API socket answered")
            if time.monotonic() > deadline:
                raise FirecrackerApiError(f"firecracker API socket {self.socket_path} did not answer")
            await asyncio.sleep(0.01)

    async def send(self, request: ApiRequest) -> Any:
        response = await self._client.request(request.method, request.path, json=request.body)
        if response.status_code >= 300:
            try:
                fault = response.json().get("fault_message", response.text)
            except ValueError:
                fault = response.text
            raise FirecrackerApiError(f"firecracker {request.method} {request.path}: {fault}")
        return response.json() if response.content else None

    async def send_all(self, requests: list[ApiRequest]) -> None:
        for request in requests:
            await self.send(request)

    async def close(self) -> None:
        await self._client.aclose()
