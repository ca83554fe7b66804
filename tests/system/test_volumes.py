"""E2B volumes (issue 26 part 4) through the official ``e2b`` SDK against a real ``forkyard serve``
(gVisor): ``Volume.create/list/get_info/destroy``, the volume content API, ``volume_mounts`` on
create shared by the sandboxes that mount it, kept across pause/resume, snapshots and forks
(E2B's fork route and our fork stream), and the SDK's clean errors for bad input."""

from __future__ import annotations

import asyncio
import uuid
from io import BytesIO

import pytest
from e2b import AsyncSandbox, Sandbox, Volume
from e2b.exceptions import (
    AuthenticationException,
    SandboxException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

from forkyard_rl import fork_stream
from tests.support.server import ServerProcess

pytestmark = pytest.mark.requires_root("real gVisor sandboxes behind a real server")

MNT = "/mnt/shared"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def run(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd).stdout.strip()


def test_volume_control_plane(forkyard_server: ServerProcess) -> None:
    vol = Volume.create(unique("ctl"))
    assert vol.volume_id and vol.token
    info = Volume.get_info(vol.volume_id)
    assert (info.name, info.token) == (vol.name, vol.token)
    assert vol.volume_id in {v.volume_id for v in Volume.list()}
    with pytest.raises(VolumeException, match="400: invalid volume name"):
        Volume.create("no spaces/or slashes")
    with pytest.raises(VolumeException, match="409: a volume named"):
        Volume.create(vol.name)
    assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)


def test_content_api_round_trip(forkyard_server: ServerProcess) -> None:
    vol = Volume.create(unique("content"))
    try:
        vol.write_file("/a.txt", "hello")
        assert vol.read_file("/a.txt") == "hello"
        vol.write_file("/bin.dat", BytesIO(bytes(range(256)) * 1000))
        assert b"".join(vol.read_file("/bin.dat", format="stream")) == bytes(range(256)) * 1000
        with pytest.raises(VolumeException, match="409"):
            vol.write_file("/a.txt", "again", force=False)
        vol.write_file("/a.txt", "again", force=True)
        made = vol.make_dir("/d/e/f", force=True)
        assert made.type.value == "directory" and made.uid == 1000 and made.mode == 0o777
        entry = vol.write_file("/d/e/f/g.txt", "x", mode=0o640, uid=1001, gid=1002)
        assert (entry.mode, entry.uid, entry.gid, entry.size) == (0o640, 1001, 1002, 1)
        assert {e.name for e in vol.list("/")} == {"a.txt", "bin.dat", "d"}
        assert vol.update_metadata("/a.txt", mode=0o600).mode == 0o600
        # A path never leaves the volume: ".." stops at its root.
        assert vol.read_file("/../../../a.txt") == "again"
        with pytest.raises(VolumePathNotFoundException):
            vol.read_file("/../../etc/passwd")
        vol.remove("/d")
        assert vol.exists("/d") is False
        with pytest.raises(VolumePathNotFoundException):
            vol.remove("/d")
        with pytest.raises(AuthenticationException):
            Volume(vol.volume_id, vol.name, token="not-the-token").read_file("/a.txt")
    finally:
        Volume.destroy(vol.volume_id)


def test_two_sandboxes_share_a_volume_across_pause_and_resume(forkyard_server: ServerProcess) -> None:
    vol = Volume.create(unique("shared"))
    a = Sandbox.create("base", timeout=300, volume_mounts={MNT: vol})
    b = Sandbox.create("base", timeout=300, volume_mounts={MNT: vol.name})
    try:
        assert [m["path"] for m in a.get_info().volume_mounts] == [MNT]
        run(a, f"echo from-a > {MNT}/a.txt")  # as the sandbox's user
        assert run(b, f"cat {MNT}/a.txt; stat -c %U {MNT}/a.txt") == "from-a\nuser"
        vol.write_file("/from-api.txt", "api")
        assert run(a, f"cat {MNT}/from-api.txt") == "api"
        assert vol.read_file("/a.txt") == "from-a\n"

        a.pause()  # frozen: its memory kept
        run(b, f"echo while-a-paused > {MNT}/b.txt")
        a = Sandbox.connect(a.sandbox_id)
        assert run(a, f"cat {MNT}/b.txt") == "while-a-paused"

        b.pause(keep_memory=False)  # filesystem only: booted again over its kept disk
        b = Sandbox.connect(b.sandbox_id)
        assert run(b, f"cat {MNT}/a.txt {MNT}/b.txt") == "from-a\nwhile-a-paused"

        with pytest.raises(VolumeException, match=r"409: volume .* is mounted by sandbox"):
            Volume.destroy(vol.volume_id)
    finally:
        a.kill()
        b.kill()
    assert Volume.destroy(vol.volume_id) is True


def test_forks_and_snapshots_mount_the_volume_again(forkyard_server: ServerProcess) -> None:
    vol = Volume.create(unique("forks"))
    parent = Sandbox.create("base", timeout=300, volume_mounts={MNT: vol})
    made: list[Sandbox] = []
    try:
        run(parent, f"echo parent > {MNT}/parent.txt")
        children = parent.fork(count=2, timeout=120)
        for i, child in enumerate(children):
            assert isinstance(child, Sandbox), child
            made.append(child)
            assert run(child, f"cat {MNT}/parent.txt && echo child{i} > {MNT}/child{i}.txt") == "parent"
        assert run(parent, f"cat {MNT}/child0.txt {MNT}/child1.txt") == "child0\nchild1"

        async def streamed() -> str:
            async_parent = await AsyncSandbox.connect(parent.sandbox_id)
            async for started in fork_stream(async_parent, 1, lifetime=120):
                assert started.sandbox is not None, started.error
                try:
                    out = await started.sandbox.commands.run(f"cat {MNT}/child1.txt; echo s > {MNT}/s.txt")
                    return out.stdout.strip()
                finally:
                    await started.sandbox.kill()
            raise AssertionError("the fork stream yielded no child")

        assert asyncio.run(streamed()) == "child1"
        assert vol.read_file("/s.txt") == "s\n"

        snap = parent.create_snapshot()
        restored = Sandbox.create(snap.snapshot_id, timeout=120)
        made.append(restored)
        assert run(restored, f"cat {MNT}/s.txt") == "s"
        with pytest.raises(SandboxException, match="400: volumeMounts cannot be given"):
            Sandbox.create(snap.snapshot_id, volume_mounts={MNT: vol})
    finally:
        for sbx in (*made, parent):
            sbx.kill()
        Volume.destroy(vol.volume_id)


@pytest.mark.parametrize(
    ("mounts", "message"),
    [
        ({MNT: "no-such-volume"}, "400: volume 'no-such-volume' not found"),
        ({"relative/path": None}, "400: invalid volume mount path"),
        ({"/proc/x": None}, "400: invalid volume mount path '/proc/x': it would cover /proc"),
        ({"/": None}, "400: invalid volume mount path"),
    ],
)
def test_bad_mounts_are_clean_400s(forkyard_server: ServerProcess, mounts: dict, message: str) -> None:
    vol = Volume.create(unique("bad"))
    try:
        with pytest.raises(SandboxException, match=message):
            Sandbox.create("base", volume_mounts={p: v or vol for p, v in mounts.items()})
    finally:
        assert Volume.destroy(vol.volume_id) is True  # nothing kept it mounted
