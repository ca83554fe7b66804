"""Sandbox limits through the official ``e2b`` SDK against a real server on the gVisor runtime:
the disk quota (``diskSizeMB``), memory that the sandbox's own kernel enforces, process limits,
a sandbox whose runsc process is killed from outside (noticed, recorded, its streams ended), and
a kill that ends open streams at once (sync and async SDK).

The server gets a template of its own, ``limits``: the shared base rootfs with a 256 MiB disk,
256 MiB of memory and one vCPU, so that filling them is quick.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, NotFoundException, Sandbox
from e2b.sandbox_sync.commands.command_handle import CommandHandle

from tests.support import SHARED_TEMPLATES
from tests.support.leaks import wait_no_host_resources
from tests.support.procs import runsc_sandbox_pid
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("runsc sandboxes, their cgroups and loop-mounted disks")

DISK_MB = 256
MEMORY_MB = 256
#: A stream must end this soon after its sandbox is killed or dies (issue 15's acceptance).
STREAM_END_SECONDS = 2.0


def _templates_dir() -> Path:
    """A templates directory with ``limits``: the shared base rootfs (linked, not copied) and
    small limits. Its ``.complete`` marker makes it a built template."""
    root = Path(tempfile.mkdtemp(prefix="ae-limits-tpl-", dir="/tmp"))
    base = SHARED_TEMPLATES / "base"
    if not (base / "rootfs").is_dir():
        pytest.skip(f"the base template is not built at {base} (make run builds it)")
    tdir = root / "limits"
    tdir.mkdir()
    (tdir / "rootfs").symlink_to(base / "rootfs")
    meta = {"template_id": "limits", "vcpus": 1, "memory_mb": MEMORY_MB, "disk_mb": DISK_MB}
    (tdir / "template.json").write_text(json.dumps(meta))
    (tdir / ".complete").write_text("")
    return root


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    templates = _templates_dir()
    # Pauses go to disk (the frozen tier keeps the sandbox as it is: nothing to re-enforce).
    env = {"FORKYARD_TEMPLATES_PATH": str(templates), "FORKYARD_PAUSE_FREEZE": "false"}
    with serve(prefix="ae-lim-", runtime="gvisor", extra_env=env) as srv:
        saved = {k: os.environ.get(k) for k in srv.sdk_env}
        os.environ.update(srv.sdk_env)  # Sandbox.list/kill/connect by id find this server
        try:
            yield srv
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    for link in templates.rglob("*"):
        if link.is_symlink():
            link.unlink()
    for path in sorted(templates.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    templates.rmdir()


@pytest.fixture
def sbx(server: ServerProcess) -> Iterator[Sandbox]:
    sandbox = Sandbox.create("limits", timeout=300)
    try:
        yield sandbox
    finally:
        try:
            sandbox.kill()
        except Exception:  # already gone (the death tests kill it themselves)
            pass
    assert wait_no_host_resources(sandbox.sandbox_id) == []


def _df_root_mb(sandbox: Sandbox) -> tuple[int, int]:
    """(size, available) of ``/`` in MiB as ``df`` inside reports them."""
    out = sandbox.commands.run("df -B1M --output=size,avail / | tail -1").stdout.split()
    return int(out[0]), int(out[1])


def _fill(sandbox: Sandbox, path: str, mb: int) -> CommandExitException:
    """Write ``mb`` MiB to ``path`` inside; the write must fail (that is what is tested)."""
    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run(f"dd if=/dev/zero of={path} bs=1M count={mb} conv=fsync", timeout=120)
    return failed.value


def _allocated_mb(directory: Path) -> float:
    """MiB the node's disk holds for everything under ``directory`` (sparse files count what
    they allocate)."""
    total = 0
    for root, dirs, files in os.walk(directory):
        # Not into mounts (the root overlay, the disk's own mount): what they show is counted
        # where it is stored (the template, the disk image).
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(root, d))]
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total / (1 << 20)


# -- disk --------------------------------------------------------------------------------------


def test_disk_quota_enospc_inside_df_shows_it_node_holds_at_most_it(
    sbx: Sandbox, server: ServerProcess
) -> None:
    size, avail = _df_root_mb(sbx)
    assert DISK_MB * 0.85 <= size <= DISK_MB, f"df / shows {size} MiB for a {DISK_MB} MiB disk"
    free_before = os.statvfs(server.data_dir).f_bavail * os.statvfs(server.data_dir).f_frsize
    failure = _fill(sbx, "/home/user/fill", 2 * DISK_MB)
    assert "No space left on device" in failure.stderr
    written = int(sbx.commands.run("stat -c %s /home/user/fill").stdout)
    assert written <= DISK_MB << 20
    # The node holds at most the quota of what the sandbox tried to write (2x the quota).
    sandbox_dir = server.data_dir / "sandboxes" / sbx.sandbox_id
    assert _allocated_mb(sandbox_dir) <= DISK_MB + 16
    free_after = os.statvfs(server.data_dir).f_bavail * os.statvfs(server.data_dir).f_frsize
    print(f"node free space: {(free_before - free_after) / (1 << 20):.0f} MiB less after the fill")
    # A full disk is the sandbox's problem only: it still answers, and deleting frees it again.
    sbx.commands.run("rm /home/user/fill && sync")
    assert _df_root_mb(sbx)[1] >= avail - 8
    assert sbx.commands.run("echo ok > /home/user/after && cat /home/user/after").stdout == "ok\n"


def test_disk_quota_survives_pause_resume_snapshot_and_fork(sbx: Sandbox, server: ServerProcess) -> None:
    sbx.commands.run(f"dd if=/dev/zero of=/home/user/half bs=1M count={DISK_MB // 2}")
    assert sbx.pause() is True  # to disk: this server does not freeze
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300)
    size, _ = _df_root_mb(resumed)
    assert DISK_MB * 0.85 <= size <= DISK_MB
    assert "No space left on device" in _fill(resumed, "/home/user/more", DISK_MB).stderr
    resumed.commands.run("rm -f /home/user/more")

    snap = resumed.create_snapshot()
    child = Sandbox.create(snap.snapshot_id, timeout=120)
    forks = resumed.fork(count=1, timeout=120)
    try:
        for other in [child, *forks]:
            assert isinstance(other, Sandbox), other
            assert DISK_MB * 0.85 <= _df_root_mb(other)[0] <= DISK_MB
            # Its own quota: what it fills is not the parent's.
            assert "No space left on device" in _fill(other, "/home/user/mine", DISK_MB).stderr
        assert resumed.commands.run("test ! -e /home/user/mine && echo own").stdout == "own\n"
    finally:
        for other in [child, *forks]:
            if isinstance(other, Sandbox):
                other.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


# -- memory and processes ----------------------------------------------------------------------


def test_memory_hog_is_killed_inside_and_the_sandbox_lives(sbx: Sandbox) -> None:
    total = int(sbx.commands.run("free -m | awk '/^Mem:/ {print $2}'").stdout)
    assert total == MEMORY_MB, f"the sandbox sees {total} MiB, its limit is {MEMORY_MB}"
    hog = "python3 -c 'a = []\nwhile True: a.append(bytearray(8 << 20))'"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run(hog, timeout=120)
    print(f"hog: exit {failed.value.exit_code}, stderr {failed.value.stderr[-200:]!r}")
    assert failed.value.exit_code != 0
    assert sbx.commands.run("echo alive").stdout == "alive\n"
    assert sbx.get_info().state.value == "running"


def test_tmp_is_bounded_so_filling_it_does_not_kill_the_sandbox(sbx: Sandbox) -> None:
    assert "No space left on device" in _fill(sbx, "/tmp/fill", MEMORY_MB).stderr
    assert sbx.commands.run("rm /tmp/fill && echo alive").stdout == "alive\n"


def test_process_limits_fork_fails_with_eagain_inside(sbx: Sandbox) -> None:
    limits = sbx.commands.run("cat /proc/self/limits").stdout
    assert re.search(r"Max processes\s+2048\s+2048", limits), limits
    # gVisor enforces RLIMIT_NPROC: below a lowered limit a fork fails, the sandbox lives.
    script = (
        "import os, resource, time\n"
        "resource.setrlimit(resource.RLIMIT_NPROC, (20, 20))\n"
        "n = 0\n"
        "try:\n"
        "    while n < 100:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('refused', n, e.errno)\n"
    )
    sbx.files.write("/home/user/forks.py", script)
    out = sbx.commands.run("python3 /home/user/forks.py", timeout=60).stdout
    assert out.startswith("refused") and out.split()[2] == "11", out  # EAGAIN
    assert sbx.commands.run("nproc").stdout.strip() in ("1", "2")  # runsc: at least 2


# -- death and streams -------------------------------------------------------------------------


def _wait_in_thread(handle: CommandHandle) -> tuple[threading.Thread, dict[str, float | BaseException]]:
    """Wait for the command in a thread; the dict gets when (monotonic) and how it ended."""
    ended: dict[str, float | BaseException] = {}

    def wait() -> None:
        try:
            handle.wait()
        except BaseException as exc:  # how it ended is what is recorded
            ended["error"] = exc
        ended["at"] = time.monotonic()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)  # the stream is open and waiting
    assert "at" not in ended
    return thread, ended


def test_kill9_of_the_runsc_process_is_noticed_and_ends_its_stream(
    sbx: Sandbox, server: ServerProcess
) -> None:
    handle = sbx.commands.run("sleep 120", background=True)
    thread, ended = _wait_in_thread(handle)
    killed = time.monotonic()
    os.kill(runsc_sandbox_pid(sbx.sandbox_id), signal.SIGKILL)
    thread.join(STREAM_END_SECONDS + 1)
    assert "at" in ended, "the command stream did not end"
    assert float(ended["at"]) - killed < STREAM_END_SECONDS  # type: ignore[arg-type]
    deadline = killed + STREAM_END_SECONDS
    while True:  # the state is gone: get answers 404, as for any sandbox E2B no longer has
        try:
            sbx.get_info()
        except NotFoundException:
            break
        assert time.monotonic() < deadline, "the dead sandbox is still reported"
        time.sleep(0.05)
    print(f"kill -9: stream ended after {float(ended['at']) - killed:.2f} s")  # type: ignore[arg-type]
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    assert wait_no_host_resources(sbx.sandbox_id, timeout=5) == []  # network and disk freed
    logs = httpx.get(
        f"{server.url}/v2/sandboxes/{sbx.sandbox_id}/logs", headers=server.headers, timeout=10
    ).json()
    assert any("died" in line["message"] for line in logs["logs"]), logs


def test_kill_ends_an_open_stream_at_once_sync(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 120", background=True)
    thread, ended = _wait_in_thread(handle)
    killed = time.monotonic()
    Sandbox.kill(sbx.sandbox_id)
    thread.join(STREAM_END_SECONDS + 1)
    assert "at" in ended, "the command stream did not end"
    print(f"sync kill: stream ended after {float(ended['at']) - killed:.2f} s")  # type: ignore[arg-type]
    assert float(ended["at"]) - killed < STREAM_END_SECONDS  # type: ignore[arg-type]


def test_kill_ends_an_open_stream_at_once_async(server: ServerProcess) -> None:
    async def scenario() -> float:
        sandbox = await AsyncSandbox.create("limits", timeout=300)
        handle = await sandbox.commands.run("sleep 120", background=True)
        waiting = asyncio.ensure_future(handle.wait())
        await asyncio.sleep(0.5)
        assert not waiting.done()
        killed = time.monotonic()
        await sandbox.kill()
        try:
            await asyncio.wait_for(waiting, STREAM_END_SECONDS + 1)
        except TimeoutError:
            pytest.fail("the command stream did not end after the kill")
        except Exception as exc:  # ended, whatever the SDK calls it
            print(f"async wait ended with {type(exc).__name__}: {exc}")
        return time.monotonic() - killed

    took = asyncio.run(scenario())
    print(f"async kill: stream ended after {took:.2f} s")
    assert took < STREAM_END_SECONDS
