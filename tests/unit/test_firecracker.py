"""Firecracker runtime: every API body checked against Firecracker's published schema; memory
merging of diff snapshots; the API client over a real Unix socket (the real boot:
tests/system/test_firecracker_kvmhost.py, in an emulated KVM host)."""

from __future__ import annotations

import asyncio
import copy
import errno
import json
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
import yaml

from forkyard.config import Settings
from forkyard.runtime import network
from forkyard.runtime.firecracker import api
from forkyard.runtime.firecracker.memory import apply_diff_memory, copy_cow, data_ranges
from forkyard.runtime.firecracker.runtime import (
    FcPaths,
    FirecrackerRuntime,
    FirecrackerState,
    boot_requests,
    fc_paths,
    restore_requests,
)
from forkyard.runtime.microvm import disks as microvm_disks
from forkyard.runtime.microvm import runtime as microvm_runtime
from forkyard.runtime.microvm import vmnet
from forkyard.runtime.network import SandboxNetwork
from forkyard.storage import atomic
from forkyard.storage.images import GuestImages, GuestKernel, init_script
from forkyard.storage.reflink import ReflinkPool
from forkyard.types import SandboxSpec, SnapshotRef, TemplateImage
from tests.support import TESTS

SCHEMA_FILE = TESTS / "data" / "firecracker" / "firecracker-api.yaml"


def _closed(schema: Any) -> Any:
    """Firecracker rejects unknown fields (serde deny_unknown_fields): close every object schema."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def spec_doc() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_FILE.read_text())


def _validate(doc: dict[str, Any], request: api.ApiRequest) -> None:
    """The body matches the schema of the operation at (method, path) in the published spec."""
    ref = _validate_body(doc, request.method, request.path, request.body)
    assert ref == f"#/definitions/{request.schema}"


def _validate_body(doc: dict[str, Any], method: str, path: str, body: Any) -> str:
    """Check ``body`` against the operation at (method, path); return its definition's $ref."""
    template = next((p for p in doc["paths"] if _path_matches(p, path)), None)
    assert template is not None, f"{path} is not an operation of the Firecracker API"
    operation = doc["paths"][template].get(method.lower())
    assert operation is not None, f"{method} {template} is not in the Firecracker API"
    body_params = [p for p in operation["parameters"] if p["in"] == "body"]
    ref: str = body_params[0]["schema"]["$ref"]
    schema = {"$ref": ref, "definitions": _closed(doc["definitions"])}
    jsonschema.Draft4Validator(schema).validate(body)
    return ref


def _path_matches(template: str, path: str) -> bool:
    t_parts, p_parts = template.strip("/").split("/"), path.strip("/").split("/")
    return len(t_parts) == len(p_parts) and all(
        t.startswith("{") or t == p for t, p in zip(t_parts, p_parts, strict=True)
    )


def _images(tmp_path: Path) -> GuestImages:
    kernel = GuestKernel(tmp_path / "vmlinux", tmp_path / "initramfs.cpio.gz", "6.1.0-test-cloud-amd64")
    return GuestImages(kernel, tmp_path / "base.ext4", tmp_path / "envd.ext4", tmp_path / "upper.ext4")


def test_boot_sequence_matches_the_published_schema(spec_doc: dict[str, Any], tmp_path: Path) -> None:
    paths = fc_paths(Settings(data_dir=tmp_path), "sb-schema")
    requests = boot_requests(
        _images(tmp_path),
        paths,
        vcpus=2,
        memory_mb=512,
        kernel=tmp_path / "vmlinux",
        boot_args="console=ttyS0",
    )
    assert [r.path for r in requests][-1] == "/actions"
    kinds = {r.schema for r in requests}
    assert {"MachineConfiguration", "BootSource", "Drive", "NetworkInterface", "Vsock", "Balloon"} <= kinds
    for request in requests:
        _validate(spec_doc, request)
    balloon = next(r for r in requests if r.schema == "Balloon")
    assert balloon.body == {
        "amount_mib": 0,
        "deflate_on_oom": True,
        "free_page_reporting": True,
        "stats_polling_interval_s": 1,
    }
    machine = next(r for r in requests if r.schema == "MachineConfiguration")
    assert machine.body is not None and machine.body["track_dirty_pages"] is True
    upper = next(r for r in requests if r.path == "/drives/upper")
    # relative on purpose: a restored VM opens its own clone in its own cwd (see runtime docstring)
    assert upper.body is not None and upper.body["path_on_host"] == "upper.ext4"


@pytest.mark.parametrize("uffd", [False, True])
def test_restore_sequence_matches_the_published_schema(
    spec_doc: dict[str, Any], tmp_path: Path, uffd: bool
) -> None:
    paths = fc_paths(Settings(data_dir=tmp_path), "sb-restore")
    requests = restore_requests(paths, tmp_path / "snap", uffd=uffd)
    for request in requests:
        _validate(spec_doc, request)
    load = requests[-1].body
    assert load is not None
    assert load["mem_backend"]["backend_type"] == ("Uffd" if uffd else "File")
    assert "vsock_override" not in load  # the vsock path is relative: no override needed
    _validate(spec_doc, api.snapshot_load(tmp_path / "s", tmp_path / "m", vsock_uds=Path("v.sock")))


@pytest.mark.parametrize(
    "request_",
    [
        api.vm_state("Paused"),
        api.vm_state("Resumed"),
        api.snapshot_create(Path("/s/vmstate"), Path("/s/mem"), "Full"),
        api.snapshot_create(Path("/s/vmstate"), Path("/s/mem.diff"), "Diff"),
        api.balloon_update(128),
        api.instance_start(),
    ],
    ids=lambda r: f"{r.method} {r.path} {json.dumps(r.body, sort_keys=True)}",
)
def test_runtime_control_requests_match_the_published_schema(
    spec_doc: dict[str, Any], request_: api.ApiRequest
) -> None:
    _validate(spec_doc, request_)


MACHINE = "MachineConfiguration"


@pytest.mark.parametrize(
    "bad",
    [
        api.ApiRequest("PUT", "/machine-config", {"vcpu_count": 0, "mem_size_mib": 128}, MACHINE),
        api.ApiRequest("PUT", "/machine-config", {"vcpus": 1, "mem_size_mib": 128}, MACHINE),
        api.ApiRequest("PATCH", "/vm", {"state": "Stopped"}, "Vm"),
        api.ApiRequest("PUT", "/snapshot/create", {"snapshot_path": "/s"}, "SnapshotCreateParams"),
        api.ApiRequest(
            "PUT",
            "/snapshot/load",
            {"snapshot_path": "/s", "mem_backend": {"backend_type": "Mmap", "backend_path": "/m"}},
            "SnapshotLoadParams",
        ),
    ],
)
def test_schema_check_rejects_bodies_firecracker_would_reject(
    spec_doc: dict[str, Any], bad: api.ApiRequest
) -> None:
    with pytest.raises(jsonschema.ValidationError):
        _validate(spec_doc, bad)


# -- diff snapshot memory -------------------------------------------------------------------------

PAGE = 4096


def test_diff_memory_is_merged_onto_the_parent(tmp_path: Path) -> None:
    parent = tmp_path / "parent.mem"
    parent.write_bytes(b"P" * (64 * PAGE))
    diff = tmp_path / "diff.mem"
    with open(diff, "wb") as f:  # sparse: dirty pages 3 and 40..41 only, like Firecracker writes it
        f.truncate(64 * PAGE)
        f.seek(3 * PAGE)
        f.write(b"D" * PAGE)
        f.seek(40 * PAGE)
        f.write(b"E" * 2 * PAGE)
    ranges = list(data_ranges(diff))
    assert ranges == [(3 * PAGE, PAGE), (40 * PAGE, 2 * PAGE)]
    out = tmp_path / "merged.mem"
    copy_cow(parent, out)
    written = apply_diff_memory(diff, out)
    assert written == 3 * PAGE
    data = out.read_bytes()
    assert len(data) == 64 * PAGE
    assert data[3 * PAGE : 4 * PAGE] == b"D" * PAGE
    assert data[40 * PAGE : 42 * PAGE] == b"E" * 2 * PAGE
    assert data[: 3 * PAGE] == b"P" * 3 * PAGE and data[42 * PAGE :] == b"P" * 22 * PAGE
    assert parent.read_bytes() == b"P" * (64 * PAGE)


# -- the client over a real Unix socket -----------------------------------------------------------


async def test_client_speaks_http_over_the_api_socket(spec_doc: dict[str, Any], tmp_path: Path) -> None:
    """A minimal server on a real Unix socket checks each body against the schema as Firecracker
    would, answering 204 or 400 with a ``fault_message``; the client must surface the fault."""
    sock = Path("/tmp") / f"aefc-{uuid.uuid4().hex[:8]}.sock"
    seen: list[tuple[str, str, Any]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if not head:
                break
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            length = int(headers.get("content-length", "0"))
            body = json.loads(await reader.readexactly(length)) if length else None
            seen.append((method, path, body))
            status, payload = "204 No Content", b""
            if path == "/vm" and body == {"state": "Paused"} and len(seen) > 1:
                status = "400 Bad Request"
                payload = json.dumps({"fault_message": "VM is already paused"}).encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Length: {len(payload)}\r\n"
                "Content-Type: application/json\r\n\r\n".encode()
                + payload
            )
            await writer.drain()

    server = await asyncio.start_unix_server(handle, path=str(sock))
    client = api.FirecrackerClient(sock)
    try:
        await client.send(api.vm_state("Paused"))
        with pytest.raises(api.FirecrackerApiError, match="VM is already paused"):
            await client.send(api.vm_state("Paused"))
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
        sock.unlink(missing_ok=True)
    assert seen[0] == ("PATCH", "/vm", {"state": "Paused"})


def test_closed_schema_copy_does_not_mutate_the_document(spec_doc: dict[str, Any]) -> None:
    before = copy.deepcopy(spec_doc["definitions"])
    _closed(spec_doc["definitions"])
    assert spec_doc["definitions"] == before


# -- the runtime's lifecycle against a fake VMM -----------------------------------------------------
#
# Firecracker is faked at its API socket: every request the runtime sends is checked against the
# published schema (a 400 with a ``fault_message`` otherwise, as Firecracker answers), and snapshot
# create and load write and read memory files as Firecracker does (Full: all of guest memory; Diff:
# a sparse file of the pages dirtied since the last create or load, which resets the dirty log).
# The VMM process is a ``sleep`` named like firecracker; the host network is recorded, not built.

GUEST_PAGES = 16


class FakeVmm:
    """One fake Firecracker: its API socket, guest memory and dirty-page log."""

    def __init__(self, doc: dict[str, Any], socket_path: Path) -> None:
        self.doc = doc
        self.socket_path = socket_path
        self.memory = bytearray(GUEST_PAGES * PAGE)
        self.dirty: set[int] = set()
        self.requests: list[tuple[str, str, Any]] = []
        self.paused = False
        self.fail_next_create = False
        self._server: asyncio.Server | None = None

    def write_page(self, page: int, byte: bytes) -> None:
        """The guest writes a page; KVM's dirty log records it."""
        self.memory[page * PAGE : (page + 1) * PAGE] = byte * PAGE
        self.dirty.add(page)

    def sent(self, path: str) -> list[Any]:
        return [body for _, p, body in self.requests if p == path]

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                length = int(headers.get("content-length", "0"))
                body = json.loads(await reader.readexactly(length)) if length else None
                status, payload = self._answer(method, path, body)
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Length: {len(payload)}\r\n"
                    "Content-Type: application/json\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, method: str, path: str, body: Any) -> tuple[str, bytes]:
        if method == "GET":
            return "200 OK", json.dumps({"state": "Paused" if self.paused else "Running"}).encode()
        self.requests.append((method, path, body))
        try:
            _validate_body(self.doc, method, path, body)
            self._act(path, body)
        except (jsonschema.ValidationError, ValueError) as exc:
            return "400 Bad Request", json.dumps({"fault_message": str(exc)}).encode()
        return "204 No Content", b""

    def _act(self, path: str, body: dict[str, Any]) -> None:
        if path == "/vm":
            self.paused = body["state"] == "Paused"
        elif path == "/snapshot/create":
            self._create(body)
        elif path == "/snapshot/load":
            self.memory = bytearray(Path(body["mem_backend"]["backend_path"]).read_bytes())
            self.dirty.clear()
            self.paused = not body.get("resume_vm", False)

    def _create(self, body: dict[str, Any]) -> None:
        if self.fail_next_create:
            self.fail_next_create = False
            raise ValueError("no space left on device")
        if not self.paused:
            raise ValueError("the microVM must be paused to create a snapshot")
        Path(body["snapshot_path"]).write_bytes(b"vmstate")
        with open(body["mem_file_path"], "wb") as f:
            if body.get("snapshot_type") == "Diff":
                f.truncate(len(self.memory))
                for page in sorted(self.dirty):
                    f.seek(page * PAGE)
                    f.write(self.memory[page * PAGE : (page + 1) * PAGE])
            else:
                f.write(self.memory)
        self.dirty.clear()


@dataclass
class FakeHost:
    """What the runtime touched on the faked host."""

    settings: Settings
    vmms: dict[str, FakeVmm] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    set_up: list[str] = field(default_factory=list)
    torn_down: list[tuple[str, SandboxNetwork | None]] = field(default_factory=list)
    live_networks: set[str] = field(default_factory=set)

    def network_for(self, sandbox_id: str, allow_internet_access: bool) -> SandboxNetwork:
        slot = len(self.set_up) + 1
        self.set_up.append(sandbox_id)
        self.live_networks.add(sandbox_id)
        return SandboxNetwork(
            sandbox_id=sandbox_id,
            netns=f"ae-{sandbox_id}",
            slot=slot,
            host_if=f"aeh{slot}",
            sandbox_if=f"aes{slot}",
            host_ip=f"10.213.0.{4 * slot + 1}",
            sandbox_ip=f"10.213.0.{4 * slot + 2}",
            allow_internet_access=allow_internet_access,
        )


@pytest_asyncio.fixture(loop_scope="function")
async def fake_host(spec_doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHost]:
    # Short: the API sockets live below it (108 bytes at most for a Unix socket path).
    data_dir = Path(tempfile.mkdtemp(prefix="aefc-", dir="/tmp"))
    host = FakeHost(Settings(data_dir=data_dir))
    images = _images(data_dir)
    for artifact in (images.kernel.vmlinux, images.kernel.initramfs, images.base, images.envd):
        artifact.write_bytes(b"artifact")

    async def setup_network(
        settings: Settings, sandbox_id: str, *, allow_internet_access: bool, egress: object = None
    ) -> SandboxNetwork:
        return host.network_for(sandbox_id, allow_internet_access)

    async def teardown_network(
        settings: Settings, sandbox_id: str, net: SandboxNetwork | None = None
    ) -> None:
        host.torn_down.append((sandbox_id, net))
        host.live_networks.discard(sandbox_id)

    async def add_tap(settings: Settings, net: SandboxNetwork) -> str:
        return "tap0"

    async def spawn(runtime: FirecrackerRuntime, net: SandboxNetwork, paths: FcPaths) -> int:
        vmm = FakeVmm(spec_doc, paths.api_socket)
        await vmm.start()
        host.vmms[net.sandbox_id] = vmm
        # argv[0] names firecracker and the sandbox directory, as the real VMM's command line does.
        proc = subprocess.Popen(  # noqa: ASYNC220  # a sleep, started at once
            [f"firecracker-fake {paths.root}", "600"], executable="/bin/sleep"
        )
        host.processes.append(proc)
        return proc.pid

    async def guest_images(cache: object, settings: Settings, tmpl: TemplateImage) -> GuestImages:
        return images

    def create_upper_drive(settings: Settings, images: GuestImages, dest: Path) -> Path:
        dest.write_bytes(b"\0" * PAGE)
        return dest

    def clone(pool: ReflinkPool, src: Path, dst: Path) -> Path:
        # A plain copy: FICLONE needs the loop-mounted XFS pool, which a unit test does not mount.
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        return dst

    async def envd_answers(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(network, "setup_network", setup_network)
    monkeypatch.setattr(network, "teardown_network", teardown_network)
    monkeypatch.setattr(vmnet, "add_tap", add_tap)
    monkeypatch.setattr(microvm_runtime, "netns_exists", lambda net: net.sandbox_id in host.live_networks)
    monkeypatch.setattr(microvm_runtime, "wait_for_envd", envd_answers)
    monkeypatch.setattr(microvm_runtime.GuestImageCache, "get", guest_images)
    monkeypatch.setattr(microvm_disks, "create_upper_drive", create_upper_drive)
    monkeypatch.setattr(ReflinkPool, "clone", clone)
    monkeypatch.setattr(FirecrackerRuntime, "_spawn", spawn)
    yield host
    for vmm in host.vmms.values():
        await vmm.stop()
    for proc in host.processes:
        proc.kill()
        proc.wait()
    shutil.rmtree(data_dir, ignore_errors=True)


def _spec(host: FakeHost, sandbox_id: str) -> SandboxSpec:
    template = TemplateImage("base", host.settings.data_dir / "rootfs", vcpus=1, memory_mb=1)
    return SandboxSpec(sandbox_id, template)


def _snapshot(host: FakeHost, snapshot_id: str, parent: SnapshotRef | None = None) -> SnapshotRef:
    return SnapshotRef(snapshot_id, host.settings.data_dir / "snapshots" / snapshot_id, parent=parent)


async def test_pause_keeps_the_network_and_the_resume_takes_it_over(fake_host: FakeHost) -> None:
    """A paused sandbox keeps its netns, tap and slot (a resume keeps its address); only the kill
    frees them."""
    runtime = FirecrackerRuntime(fake_host.settings)
    spec = _spec(fake_host, "fcpause")
    instance = await runtime.create(spec)
    net = instance.network
    assert net is not None
    pause = _snapshot(fake_host, "pause1")
    await runtime.snapshot(instance, pause, stop=True)

    assert fake_host.torn_down == []
    paths = fc_paths(fake_host.settings, spec.sandbox_id)
    assert microvm_runtime.read_marker(paths, FirecrackerState) == FirecrackerState(network=net, paused=True)
    assert not await runtime.is_alive(instance)
    assert not paths.api_socket.exists() and not paths.layer_dir.exists()

    resumed = await runtime.restore(spec, pause)
    assert fake_host.set_up == [spec.sandbox_id]  # once, by the create
    assert resumed.address == instance.address == net.sandbox_ip
    assert resumed.envd_url == instance.envd_url
    load = fake_host.vmms[spec.sandbox_id].sent("/snapshot/load")
    assert [body["mem_backend"]["backend_path"] for body in load] == [str(pause.path / "memory.bin")]

    await runtime.kill(resumed)
    assert fake_host.torn_down == [(spec.sandbox_id, net)]
    assert not paths.root.exists()


async def test_a_snapshot_with_its_parent_is_a_diff_applied_onto_the_parent(
    fake_host: FakeHost, spec_doc: dict[str, Any]
) -> None:
    """Diff when ``dest.parent`` is the snapshot the VM's dirty log runs from (the one it was
    last snapshotted to or restored from): the request is a schema-valid ``Diff`` and the
    snapshot's ``memory.bin`` is the parent's memory with the dirty pages applied; else Full."""
    runtime = FirecrackerRuntime(fake_host.settings)
    first = await runtime.create(_spec(fake_host, "fca"))
    vmm = fake_host.vmms["fca"]
    vmm.write_page(1, b"a")
    vmm.write_page(2, b"a")
    s1 = _snapshot(fake_host, "s1")
    await runtime.snapshot(first, s1, stop=False)
    vmm.write_page(5, b"b")
    s2 = _snapshot(fake_host, "s2", parent=s1)
    await runtime.snapshot(first, s2, stop=False)

    creates = vmm.sent("/snapshot/create")
    assert [body["snapshot_type"] for body in creates] == ["Full", "Diff"]
    assert creates[1] == {
        "snapshot_path": str(s2.path / "vmstate.bin"),
        "mem_file_path": str(s2.path / "memory.diff"),
        "snapshot_type": "Diff",
    }
    _validate(
        spec_doc,
        api.snapshot_create(Path(creates[1]["snapshot_path"]), Path(creates[1]["mem_file_path"]), "Diff"),
    )
    assert (s2.path / "memory.bin").read_bytes() == bytes(vmm.memory)
    assert not (s2.path / "memory.diff").exists()
    assert json.loads((s2.path / "vm.json").read_text())["type"] == "Diff"
    assert not vmm.paused

    # A VM restored from s2 starts its dirty log there: its diff against s2 restores its memory.
    second = await runtime.restore(_spec(fake_host, "fcb"), s2)
    restored = fake_host.vmms["fcb"]
    assert restored.memory == vmm.memory
    restored.write_page(7, b"c")
    s3 = _snapshot(fake_host, "s3", parent=s2)
    await runtime.snapshot(second, s3, stop=False)
    assert restored.sent("/snapshot/create")[0]["snapshot_type"] == "Diff"
    assert (s3.path / "memory.bin").read_bytes() == bytes(restored.memory)

    # s1 is no longer where the first VM's dirty log runs from (s2 is): a diff would lose page 5.
    s4 = _snapshot(fake_host, "s4", parent=s1)
    await runtime.snapshot(first, s4, stop=False)
    assert vmm.sent("/snapshot/create")[-1]["snapshot_type"] == "Full"
    assert (s4.path / "memory.bin").read_bytes() == bytes(vmm.memory)
    for instance in (first, second):
        await runtime.kill(instance)


@pytest.mark.parametrize("stop", [False, True], ids=["snapshot", "pause"])
async def test_a_failed_snapshot_leaves_the_vm_running_and_the_next_one_full(
    fake_host: FakeHost, stop: bool
) -> None:
    runtime = FirecrackerRuntime(fake_host.settings)
    instance = await runtime.create(_spec(fake_host, "fcf"))
    vmm = fake_host.vmms["fcf"]
    s1 = _snapshot(fake_host, "s1")
    await runtime.snapshot(instance, s1, stop=False)
    vmm.fail_next_create = True
    with pytest.raises(api.FirecrackerApiError, match="no space left"):
        await runtime.snapshot(instance, _snapshot(fake_host, "s2", parent=s1), stop=stop)
    assert not vmm.paused and await runtime.is_alive(instance)
    assert fake_host.torn_down == []
    # The failed create may have reset the dirty log: s1 is no base for a diff any more.
    await runtime.snapshot(instance, _snapshot(fake_host, "s3", parent=s1), stop=False)
    assert vmm.sent("/snapshot/create")[-1]["snapshot_type"] == "Full"
    await runtime.kill(instance)


async def test_state_files_are_written_whole(fake_host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker and vm.json are replaced in one step: a write that fails half-way (disk full
    at the fsync) leaves the previous marker, which a kill then still finds the VM by."""
    runtime = FirecrackerRuntime(fake_host.settings)
    instance = await runtime.create(_spec(fake_host, "fcw"))
    paths = fc_paths(fake_host.settings, "fcw")
    before = paths.marker.read_text()

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch, pytest.raises(OSError, match="No space left"):
        patch.setattr(atomic.os, "fsync", disk_full)
        await runtime.snapshot(instance, _snapshot(fake_host, "s1"), stop=False)
    assert paths.marker.read_text() == before
    assert [p.name for p in paths.root.iterdir() if p.name.endswith(".tmp")] == []
    await runtime.kill(instance)
    assert not await runtime.is_alive(instance) and not paths.root.exists()


def test_bodies_follow_the_binary_release(spec_doc: dict[str, Any], tmp_path: Path) -> None:
    """Firecracker rejects fields newer than itself: v1.12 gets no ``free_page_reporting`` and the
    old name of the load's dirty-page flag; both bodies still fit the newest schema."""
    old = api.ApiLevel((1, 12, 1))
    balloon = api.balloon(0, level=old)
    assert balloon.body is not None and "free_page_reporting" not in balloon.body
    assert api.balloon(0).body is not None and api.balloon(0).body["free_page_reporting"] is True
    paths = fc_paths(Settings(data_dir=tmp_path), "sb-level")
    load = restore_requests(paths, tmp_path / "snap", uffd=False, level=old)[-1].body
    assert load is not None and load["enable_diff_snapshots"] is True and "track_dirty_pages" not in load
    assert api.ApiLevel((1, 13, 0)).load_dirty_pages_field == "track_dirty_pages"
    for request in (balloon, restore_requests(paths, tmp_path / "snap", uffd=True, level=old)[-1]):
        _validate(spec_doc, request)


def test_uffd_region_page_size_kib_is_in_bytes() -> None:
    """Firecracker's deprecated ``page_size_kib`` carries bytes despite its name (v1.12 sends
    both; a release sending only it must not make 4 MiB pages of 4 KiB ones)."""
    from forkyard.runtime.firecracker.uffd import GuestRegion

    item = {"base_host_virt_addr": 4096, "size": 8192, "offset": 0}
    assert GuestRegion.from_json(item | {"page_size_kib": 4096}).page_size == 4096
    assert GuestRegion.from_json(item | {"page_size": 4096, "page_size_kib": 4096}).page_size == 4096


def test_boot_args_name_each_drive_by_the_serial_firecracker_gives_it(tmp_path: Path) -> None:
    """Firecracker's virtio-blk serial is the file's dev, rdev and inode (not the drive id, which
    the guest never sees): the guest's init finds base, upper and envd by what the cmdline says."""
    images = _images(tmp_path)
    paths = fc_paths(Settings(data_dir=tmp_path), "sb-serial")
    for f in (images.base, images.envd, paths.upper):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"\0" * 512)
    args = FirecrackerRuntime(Settings(data_dir=tmp_path)).boot_args(images, paths).split()
    serials = dict(
        a.removeprefix("forkyard.serial.").split("=") for a in args if a.startswith("forkyard.serial.")
    )
    st = paths.upper.stat()
    assert serials["upper"] == f"{st.st_dev}{st.st_rdev}{st.st_ino}"[:20]
    assert set(serials) == {"base", "upper", "envd"} and len(set(serials.values())) == 3
    assert "forkyard.serial.$1=" in init_script()  # the init reads them
