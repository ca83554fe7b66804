"""Firecracker runtime: every API body checked against Firecracker's published schema; memory
merging of diff snapshots; the API client over a real Unix socket (the real boot:
tests/system/test_firecracker_boot.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agentenv.config import Settings
from agentenv.types import SandboxSpec, SnapshotRef, TemplateImage
from agentenv.runtime.firecracker import api
from agentenv.runtime.firecracker.memory import data_ranges, merge_diff_memory
from agentenv.runtime.firecracker.runtime import (
    FirecrackerRuntime,
    boot_requests,
    fc_paths,
    restore_requests,
)
from agentenv.storage.images import GuestImages, GuestKernel
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
    template = next(
        (p for p in doc["paths"] if _path_matches(p, request.path)), None
    )
    assert template is not None, f"{request.path} is not an operation of the Firecracker API"
    operation = doc["paths"][template].get(request.method.lower())
    assert operation is not None, f"{request.method} {template} is not in the Firecracker API"
    body_params = [p for p in operation["parameters"] if p["in"] == "body"]
    ref = body_params[0]["schema"]["$ref"]
    assert ref == f"#/definitions/{request.schema}"
    schema = {"$ref": ref, "definitions": _closed(doc["definitions"])}
    jsonschema.Draft4Validator(schema).validate(request.body)


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
        _images(tmp_path), paths, vcpus=2, memory_mb=512,
        kernel=tmp_path / "vmlinux", boot_args="console=ttyS0",
    )
    assert [r.path for r in requests][-1] == "/actions"
    kinds = {r.schema for r in requests}
    assert {"MachineConfiguration", "BootSource", "Drive", "NetworkInterface", "Vsock", "Balloon"} <= kinds
    for request in requests:
        _validate(spec_doc, request)
    balloon = next(r for r in requests if r.schema == "Balloon")
    assert balloon.body == {
        "amount_mib": 0, "deflate_on_oom": True, "free_page_reporting": True, "stats_polling_interval_s": 1,
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
            "PUT", "/snapshot/load",
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
    written = merge_diff_memory(parent, diff, out)
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
                "Content-Type: application/json\r\n\r\n".encode() + payload
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
