"""End to end with the official ``e2b`` Python SDK (sync) against a real ``forkyard serve``
with the real gVisor runtime."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, FileType, NotFoundException, Sandbox, SandboxQuery
from e2b.exceptions import SandboxException
from e2b.sandbox.commands.command_handle import PtySize

from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def sbx(forkyard_server: ServerProcess) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300, metadata={"suite": "sdk-sync"}, envs={"GREETING": "hello"})
    try:
        yield sandbox
    finally:
        sandbox.kill()
    assert wait_no_host_resources(sandbox.sandbox_id) == []


def test_run_stdout_stderr_exit_code(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo hi && echo oops >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "oops\n", 0)
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo out; exit 7")
    assert exc.value.exit_code == 7 and exc.value.stdout == "out\n"
    assert sbx.commands.run("echo $GREETING").stdout == "hello\n"  # envs from create (/init)
    assert sbx.commands.run("whoami").stdout.strip() == "user"


def test_coreutils_ls_and_stat_work(sbx: Sandbox) -> None:
    """coreutils pass AT_NO_AUTOMOUNT to statx, which runsc 2022-12 rejected (EINVAL); the pinned
    2024 build answers it (a regression test for going back)."""
    sbx.files.write("/home/user/listed.txt", "x")
    result = sbx.commands.run("ls -la /home/user/ && stat -c '%s %U' /home/user/listed.txt && ls /tmp")
    assert "listed.txt" in result.stdout
    assert "1 user" in result.stdout


def test_streaming_callbacks(sbx: Sandbox) -> None:
    seen: list[tuple[str, float]] = []
    r = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.4; done; echo bad >&2",
        on_stdout=lambda s: seen.append((s, time.monotonic())),
        on_stderr=lambda s: seen.append(("ERR:" + s, time.monotonic())),
    )
    assert r.exit_code == 0
    assert "".join(s for s, _ in seen if not s.startswith("ERR:")) == "line1\nline2\nline3\n"
    assert any(s.startswith("ERR:bad") for s, _ in seen)
    times = [t for s, t in seen if s.startswith("line")]
    assert times[-1] - times[0] > 0.5  # delivered as produced, not at the end


def test_background_wait_kill_and_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 1; echo done", background=True)
    assert h.wait().stdout == "done\n"
    long = sbx.commands.run("sleep 600", background=True)
    assert any(p.pid == long.pid for p in sbx.commands.list())
    assert long.kill() is True
    with pytest.raises(CommandExitException):
        long.wait()
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "from stdin\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "from stdin\n"


def test_pty_create_resize_kill(sbx: Sandbox) -> None:
    out = bytearray()
    pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    sbx.pty.resize(pty.pid, PtySize(rows=40, cols=132))
    sbx.pty.send_stdin(pty.pid, b"stty size; exit\n")
    result = pty.wait(on_pty=lambda data: out.extend(data))
    assert b"40 132" in bytes(out), bytes(out)
    assert result.exit_code == 0
    pty2 = sbx.pty.create(PtySize(rows=10, cols=10))
    assert sbx.pty.kill(pty2.pid) is True


def test_files_roundtrip(sbx: Sandbox) -> None:
    base = f"/home/user/t-{os.urandom(3).hex()}"
    sbx.files.make_dir(base)
    info = sbx.files.write(f"{base}/a.txt", "alpha")
    assert info.path == f"{base}/a.txt"
    assert sbx.files.read(f"{base}/a.txt") == "alpha"
    assert sbx.files.read(f"{base}/a.txt", format="bytes") == b"alpha"
    assert sbx.files.exists(f"{base}/a.txt") and not sbx.files.exists(f"{base}/zz")
    sbx.files.rename(f"{base}/a.txt", f"{base}/b.txt")
    names = {e.name: e.type for e in sbx.files.list(base)}
    assert names == {"b.txt": FileType.FILE}
    sbx.files.remove(f"{base}/b.txt")
    assert sbx.files.list(base) == []
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{base}/b.txt")


def test_watch_dir(sbx: Sandbox) -> None:
    d = f"/home/user/w-{os.urandom(3).hex()}"
    sbx.files.make_dir(d)
    handle = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/new.txt", "x")
    deadline = time.monotonic() + 10
    names: set[str] = set()
    while time.monotonic() < deadline and "new.txt" not in names:
        names |= {e.name for e in handle.get_new_events()}
        time.sleep(0.2)
    handle.stop()
    assert "new.txt" in names


def test_50_mib_upload_and_download_intact(sbx: Sandbox, tmp_path: Path) -> None:
    payload = os.urandom(50 << 20)
    sbx.files.write("/home/user/big.bin", payload)
    r = sbx.commands.run("sha256sum /home/user/big.bin")
    assert r.stdout.split()[0] == hashlib.sha256(payload).hexdigest()
    back = sbx.files.read("/home/user/big.bin", format="bytes")
    assert len(back) == len(payload) and back == payload
    sbx.files.remove("/home/user/big.bin")


def test_path_traversal_stays_in_sandbox(sbx: Sandbox, forkyard_server: ServerProcess) -> None:
    marker = Path(f"/tmp/forkyard-host-secret-{os.urandom(4).hex()}")
    marker.write_text("host secret")
    try:
        # ../../.. from the home directory lands at the sandbox's own root.
        assert sbx.files.read("../../../etc/hostname").strip() == "sandbox"
        with pytest.raises(NotFoundException):
            sbx.files.read(f"../../../..{marker}")
        # The same through the raw HTTP API, bypassing the SDK's path handling.
        headers = {
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sbx._envd_access_token or "",
        }
        resp = httpx.get(
            f"{forkyard_server.url}/files", params={"path": f"/../../../../..{marker}"}, headers=headers
        )
        assert resp.status_code == 404 and "host secret" not in resp.text
    finally:
        marker.unlink()


def test_info_timeout_and_list(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.template_id == "base"
    assert info.metadata == {"suite": "sdk-sync"} and info.state.value == "running"
    sbx.set_timeout(120)
    left = (sbx.get_info().end_at - sbx.get_info().started_at).total_seconds()
    assert left > 100
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": "sdk-sync"})).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "nope"})).next_items() == []
    assert sbx.is_running()
    metrics = sbx.get_metrics()
    assert metrics and metrics[-1].mem_total > 0


def test_short_timeout_sandbox_is_gone(forkyard_server: ServerProcess) -> None:
    s = Sandbox.create(timeout=3)
    assert s.commands.run("echo alive").stdout == "alive\n"
    time.sleep(5)
    assert not s.is_running()
    with pytest.raises(SandboxException):
        s.commands.run("echo still")
    assert Sandbox.kill(s.sandbox_id) is False  # already gone: 404
    assert wait_no_host_resources(s.sandbox_id) == []


def test_unknown_template_and_kill(forkyard_server: ServerProcess) -> None:
    with pytest.raises(SandboxException) as exc:
        Sandbox.create(template="does-not-exist")
    assert "not found" in str(exc.value)
    s = Sandbox.create()
    s.kill()
    assert not s.is_running()
    assert wait_no_host_resources(s.sandbox_id) == []


def test_concurrent_creates(forkyard_server: ServerProcess) -> None:
    made: list[Sandbox] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            s = Sandbox.create(timeout=120, metadata={"suite": "concurrent"})
            made.append(s)
        except BaseException as exc:  # collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert len({s.sandbox_id for s in made}) == 16
        assert all(s.commands.run("echo ok").stdout == "ok\n" for s in made[:4])
    finally:
        for s in made:
            s.kill()
    for s in made:
        assert wait_no_host_resources(s.sandbox_id) == []
