"""The node's disk full (issue 28): a server whose data dir is a small tmpfs of its own, filled by
the test until the kernel says ENOSPC. A snapshot and a create are then refused with E2B's 507
(``{"code": 507, "message"}``), no half-written snapshot is left committed (none listed, no
directory under ``snapshots/``), the running sandbox still answers with its file; once space is
freed, snapshots work again and restore with the file.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxException

from tests.support import base_template_missing
from tests.support.leaks import mounts_under
from tests.support.server import ServerProcess, start_server

pytestmark = pytest.mark.requires_root("mounts a tmpfs, runs gVisor sandboxes")

#: Room for a sandbox and one snapshot of it (with a template snapshot too: ~150 MiB together),
#: not much more.
DATA_DIR_SIZE = "400m"
TOKEN_FILE = "/home/user/token.txt"
FILLER = "filler"


@pytest.fixture(scope="module")
def full_dir() -> Iterator[Path]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    data_dir = Path(tempfile.mkdtemp(prefix="fy-full-", dir="/tmp"))
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DATA_DIR_SIZE}", "tmpfs", str(data_dir)]
    subprocess.run(mount, check=True)
    try:
        yield data_dir
    finally:
        subprocess.run(["umount", "--lazy", str(data_dir)], check=False)
        data_dir.rmdir()
        assert mounts_under(data_dir) == []


@pytest.fixture(scope="module")
def server(full_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("disk-full-log")  # the log must not need the full disk
    # No template snapshot: the node's first create would start one in the background, and a fill
    # racing it fails that one (whose cleanup frees space for the create under test) or lets it
    # commit after the "before" listing (CI saw both).
    env = {"FORKYARD_SNAPSHOT_STANDBYS": "0", "FORKYARD_TEMPLATE_SNAPSHOTS": "false"}
    running = start_server(full_dir, log_dir=log_dir, extra_env=env)
    try:
        yield running
    finally:
        running.kill_all_sandboxes()
        running.stop()


def _fill(data_dir: Path) -> int:
    """Write to a file on ``data_dir`` until the kernel says ENOSPC; how many bytes went in."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(data_dir / FILLER, "wb", buffering=0) as out:
        try:
            while True:
                written += out.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return written


def _snapshot_dirs(data_dir: Path) -> list[str]:
    where = data_dir / "snapshots"
    return sorted(p.name for p in where.iterdir()) if where.is_dir() else []


def test_a_full_disk_refuses_snapshots_and_creates_with_507_and_harms_no_running_sandbox(
    server: ServerProcess, full_dir: Path
) -> None:
    sbx = Sandbox.create(timeout=300, **server.sdk_opts)
    try:
        sbx.files.write(TOKEN_FILE, "before the disk filled")
        listed_before = _snapshot_ids(server)
        dirs_before = _snapshot_dirs(full_dir)
        assert _fill(full_dir) > 0
        try:
            with pytest.raises(SandboxException) as refused:
                sbx.create_snapshot()
            assert getattr(refused.value, "status_code", None) == 507, refused.value
            assert "disk is full" in str(refused.value)
            with pytest.raises(SandboxException) as create_refused:
                Sandbox.create(timeout=60, **server.sdk_opts)
            assert getattr(create_refused.value, "status_code", None) == 507, create_refused.value
            # Nothing half-written is committed: no new snapshot listed, no new directory.
            assert _snapshot_ids(server) == listed_before
            assert _snapshot_dirs(full_dir) == dirs_before
            # The running sandbox is unharmed.
            assert sbx.commands.run(f"cat {TOKEN_FILE}").stdout == "before the disk filled"
        finally:
            (full_dir / FILLER).unlink()
        snap = sbx.create_snapshot()
        restored = Sandbox.create(snap.snapshot_id, timeout=60, **server.sdk_opts)
        with contextlib.closing(_Killer(restored)):
            assert restored.files.read(TOKEN_FILE) == "before the disk filled"
    finally:
        sbx.kill()


def _snapshot_ids(server: ServerProcess) -> list[str]:
    resp = httpx.get(server.url + "/snapshots", headers=server.headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return sorted(item["snapshotID"] for item in resp.json())


class _Killer:
    def __init__(self, sbx: Sandbox) -> None:
        self.sbx = sbx

    def close(self) -> None:
        self.sbx.kill()
