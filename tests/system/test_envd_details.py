"""E2B's envd and API details (issue 10, section 3), each through the official SDK against a real
``forkyard serve`` on the gVisor runtime: stream deadlines, file metadata on gVisor's root,
boot ids, symlinks, watch events, the filesystem-only pause, signed URLs, the node's /metrics.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Iterator

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, TimeoutException
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from e2b.sandbox.signature import get_signature

from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess

BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
#: Upload metadata: keys are lowercased by envd (envd.yaml POST /files).
METADATA = {"Owner": "rl-run-7", "step": "42"}


def _boot_id(sbx: Sandbox) -> str:
    out = sbx.commands.run(BOOT_ID).stdout.strip()
    assert len(out) == 36 and out.count("-") == 4, out
    return out


def _wait_paused(sandbox_id: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while Sandbox.get_info(sandbox_id).state.value != "paused":
        assert time.monotonic() < deadline, f"sandbox {sandbox_id} did not auto-pause"
        time.sleep(0.3)


@pytest.fixture
def sbx(forkyard_server: ServerProcess) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=180)
    yield sandbox
    sandbox.kill()


@pytest.mark.asyncio(loop_scope="session")
async def test_connect_timeout_ends_a_quiet_command_stream(forkyard_server: ServerProcess) -> None:
    """The async SDK's ``timeout`` is the stream's ``Connect-Timeout-Ms``; envd ends the stream
    with ``deadline_exceeded`` then (as connect-go does), which the SDK raises as a timeout."""
    sandbox = await AsyncSandbox.create(timeout=120)
    try:
        started = time.monotonic()
        handle = await sandbox.commands.run("sleep 60", background=True, timeout=2)
        with pytest.raises(TimeoutException) as info:
            await asyncio.wait_for(handle.wait(), 30)
        took = time.monotonic() - started
        assert 1.5 < took < 15, took
        assert "deadline" in str(info.value).lower()
        # Only the stream ended: the process runs on, as a client that left (E2B's too).
        assert any(p.pid == handle.pid for p in await sandbox.commands.list())
    finally:
        await sandbox.kill()


def test_connect_timeout_on_the_wire(sbx: Sandbox) -> None:
    """The raw Connect stream: its end-of-stream message carries ``deadline_exceeded``."""
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Timeout-Ms": "1000",
        "X-Access-Token": sbx._envd_access_token or "",
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
    }
    body = b'{"process": {"cmd": "/bin/sleep", "args": ["30"]}}'
    frame = b"\x00" + len(body).to_bytes(4, "big") + body
    started = time.monotonic()
    resp = httpx.post(sbx.envd_api_url + "/process.Process/Start", content=frame, headers=headers, timeout=20)
    assert time.monotonic() - started < 10
    assert resp.status_code == 200
    end = resp.content.rsplit(b"\x02", 1)[-1]
    assert b'"deadline_exceeded"' in end and b"context deadline exceeded" in end, resp.content


def test_file_metadata_on_the_gvisor_root(sbx: Sandbox) -> None:
    """gVisor's gofer has no user xattrs; envd's metadata store stands in (filesystem/metadata_store.py)."""
    path = "/home/user/meta.txt"
    sbx.files.write(path, "data", metadata=METADATA)
    wanted = {k.lower(): v for k, v in METADATA.items()}
    assert sbx.files.get_info(path).metadata == wanted
    assert {e.name: e.metadata for e in sbx.files.list("/home/user")}["meta.txt"] == wanted
    sbx.files.rename(path, "/home/user/moved.txt")  # metadata follows the file, as an xattr would
    assert sbx.files.get_info("/home/user/moved.txt").metadata == wanted
    sbx.files.write("/home/user/moved.txt", "again")  # an upload without headers clears it
    assert not sbx.files.get_info("/home/user/moved.txt").metadata
    sbx.files.write("/home/user/d/f.txt", "x", metadata={"k": "v"})
    sbx.files.remove("/home/user/d")
    sbx.files.write("/home/user/d/f.txt", "x")
    assert not sbx.files.get_info("/home/user/d/f.txt").metadata  # removed with its directory


def test_symlink_info_reports_the_target_type(sbx: Sandbox) -> None:
    sbx.commands.run("ln -s /etc /home/user/to-dir && ln -s /etc/hostname /home/user/to-file")
    to_dir = sbx.files.get_info("/home/user/to-dir")
    to_file = sbx.files.get_info("/home/user/to-file")
    assert (to_dir.type.value, to_dir.symlink_target) == ("dir", "/etc")
    assert (to_file.type.value, to_file.symlink_target) == ("file", "/etc/hostname")


def test_a_written_file_shows_e2bs_events(sbx: Sandbox) -> None:
    """E2B's envd writes in place (upload.go: chown, open O_TRUNC, write)."""
    handle = sbx.files.watch_dir("/home/user")
    try:
        sbx.files.write("/home/user/w.txt", "one")
        sbx.files.write("/home/user/w.txt", "two")
        sbx.files.write("/home/user/empty.txt", "")
        events: list[tuple[str, FilesystemEventType]] = []
        deadline = time.monotonic() + 10
        while len(events) < 7 and time.monotonic() < deadline:
            events += [(e.name, e.type) for e in handle.get_new_events()]
            time.sleep(0.1)
    finally:
        handle.stop()
    c, m, w = FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE
    assert events == [
        ("w.txt", c), ("w.txt", m), ("w.txt", w),  # new file
        ("w.txt", m), ("w.txt", w),  # overwritten
        ("empty.txt", c), ("empty.txt", m),  # new and empty: nothing written
    ]  # fmt: skip


def test_boot_id_is_kept_by_pause_and_snapshots(sbx: Sandbox) -> None:
    """gVisor's procfs has ``boot_id`` (runsc 2024-07): drawn when the sentry boots and part of its
    checkpoint, so a resume and a restore keep it (measured here; the filesystem-only pause below
    boots and gets a new one)."""
    first = _boot_id(sbx)
    assert _boot_id(sbx) == first  # one per boot, not per read
    sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert _boot_id(resumed) == first
    snapshot = sbx.create_snapshot()
    child = Sandbox.create(snapshot.snapshot_id, timeout=60)
    try:
        assert _boot_id(child) == first  # the same kernel, restored
    finally:
        child.kill()
        Sandbox.delete_snapshot(snapshot.snapshot_id)
    # Creates from a template restore its snapshot too: like E2B's (every sandbox resumes the
    # template's memory snapshot), they share the template boot's id; only a boot makes a new one.


def test_filesystem_only_pause(sbx: Sandbox, forkyard_server: ServerProcess) -> None:
    """``pause(keep_memory=False)``: processes end, files (and their metadata) stay, the resume
    boots afresh with a new boot id; a kill while so paused removes the kept disk."""
    boot = _boot_id(sbx)
    sbx.files.write("/home/user/kept.txt", "kept", metadata={"k": "v"})
    sbx.commands.run("echo in-memory > /tmp/tmpfs.txt")  # /tmp is a tmpfs: memory
    sleeper = sbx.commands.run("sleep 600", background=True)
    assert sbx.pause(keep_memory=False)
    assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    assert wait_no_host_resources(sbx.sandbox_id) == []  # no process, mount or netns: only files
    scratch = forkyard_server.data_dir / "sandboxes" / sbx.sandbox_id
    assert (scratch / "layers.json").exists()
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.read("/home/user/kept.txt") == "kept"
    assert resumed.files.get_info("/home/user/kept.txt").metadata == {"k": "v"}
    assert not resumed.files.exists("/tmp/tmpfs.txt")
    assert sleeper.pid not in [p.pid for p in resumed.commands.list()]
    assert _boot_id(resumed) != boot
    assert resumed.commands.run("echo alive").stdout == "alive\n"
    assert resumed.pause(mode="filesystem")
    Sandbox.kill(sbx.sandbox_id)
    deadline = time.monotonic() + 30  # a kill releases the disk after it answers
    while scratch.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not scratch.exists()


def test_auto_pause_without_memory(forkyard_server: ServerProcess) -> None:
    """``lifecycle`` with ``mode: filesystem`` (``autoPauseMemory: false``): the timeout's pause
    is filesystem-only."""
    sbx = Sandbox.create(timeout=4, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        boot = _boot_id(sbx)
        sbx.files.write("/home/user/kept.txt", "kept")
        _wait_paused(sbx.sandbox_id)
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert resumed.files.read("/home/user/kept.txt") == "kept"
        assert _boot_id(resumed) != boot
    finally:
        Sandbox.kill(sbx.sandbox_id)
    # The SDK refuses the combination itself; the API does too (openapi.yml autoPauseMemory).
    resp = httpx.post(
        forkyard_server.url + "/sandboxes",
        headers=forkyard_server.headers,
        json={
            "templateID": "base",
            "autoPause": True,
            "autoPauseMemory": False,
            "autoResume": {"enabled": True},
        },
    )
    assert resp.status_code == 400 and resp.json() == {
        "code": 400,
        "message": "autoResume cannot be combined with autoPauseMemory=false",
    }


def test_sudo_for_user_although_the_runtime_sets_no_new_privs(sbx: Sandbox) -> None:
    """runsc (2024-07, the build Debian ships) ignores the OCI spec's ``noNewPrivileges: false``
    and the sentry ignores set-uid bits (gVisor issue #212), so every task has the flag; sudo
    still works for ``user`` because envd brokers it (tests/system/test_e2b_conventions.py)."""
    nnp = sbx.commands.run("python3 -c 'import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'")
    assert nnp.stdout.strip() in ("0", "1")
    assert sbx.commands.run("sudo -n id -u", user="user").stdout == "0\n"


def test_signed_urls_through_the_sandbox_url(sbx: Sandbox, forkyard_server: ServerProcess) -> None:
    """With ``E2B_SANDBOX_URL`` the SDK's signed URLs carry no routing (no header, no host name):
    the proxy finds the sandbox whose token signs them."""
    assert sbx.envd_api_url == forkyard_server.url
    up = sbx.upload_url("/home/user/signed.txt", use_signature_expiration=60)
    assert up.startswith(forkyard_server.url + "/files?")
    done = httpx.post(up, files={"file": ("signed.txt", b"via url")})
    assert done.status_code == 200, done.text
    down = sbx.download_url("/home/user/signed.txt", use_signature_expiration=60)
    assert httpx.get(down).text == "via url"
    assert sbx.files.read("/home/user/signed.txt") == "via url"

    # An expired signature (signed 10 s in the past): E2B envd's own 401 (auth.go validateSigning).
    sig = get_signature("/home/user/signed.txt", "read", None, sbx._envd_access_token, -10)
    expired = f"{forkyard_server.url}/files?" + urllib.parse.urlencode(
        {
            "path": "/home/user/signed.txt",
            "signature": sig["signature"],
            "signature_expiration": sig["expiration"],
        }
    )
    resp = httpx.get(expired)
    assert (resp.status_code, resp.json()) == (401, {"code": 401, "message": "signature is already expired"})
    forged = down.replace("signature=v1_", "signature=v1_x")
    assert httpx.get(forged).status_code in (401, 404)


def test_node_metrics(sbx: Sandbox, forkyard_server: ServerProcess) -> None:
    """``GET /metrics`` (our extension): sandboxes by state, tier and runtime, lifecycle latency
    histograms, node capacity beside what sandboxes are allotted."""
    sbx.commands.run("true")
    resp = httpx.get(forkyard_server.url + "/metrics", headers=forkyard_server.headers)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert 'forkyard_sandboxes{runtime="gvisor",state="running",tier=""}' in text
    assert "# TYPE forkyard_lifecycle_seconds histogram" in text
    assert 'le="+Inf",operation="create"}' in text
    for line in (
        "forkyard_node_cpus ",
        'forkyard_node_memory_bytes{kind="total"}',
        'forkyard_node_memory_bytes{kind="available"}',
        'forkyard_node_disk_bytes{kind="free"}',
        'forkyard_node_allotted{resource="vcpus"}',
        'forkyard_node_allotted{resource="memory_bytes"}',
    ):
        assert line in text, line
    assert httpx.get(forkyard_server.url + "/metrics").status_code == 401
