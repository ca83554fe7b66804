"""envd on the host, driven by the official e2b SDK (2.63.0) the way a sandbox user drives it.

envd runs as a real subprocess (``python -m forkyard.envd``) on a free loopback port; the SDK's
``Sandbox`` is pointed straight at it (``sandbox_url``), with no control plane in between.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import h11
import httpx
import pytest
from connectrpc.code import Code
from connectrpc.codec import proto_binary_codec
from connectrpc.errors import ConnectError
from e2b import Sandbox
from e2b.connection_config import ConnectionConfig
from e2b.envd.client_shared import ENVD_JSON_CODEC
from e2b.envd.client_sync import as_stream
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
)
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType
from packaging.version import Version
from protobuf import Oneof

from forkyard.types import ENVD_INIT_REVALIDATE
from tests.support import REPO
from tests.support import free_port as _free_port

ENVD_VERSION = Version("0.6.4")

pytestmark = pytest.mark.requires_root("envd runs on the host as root (user switching)")


@dataclass
class Envd:
    url: str
    proc: subprocess.Popen[bytes]
    startup_seconds: float
    log: Path
    token: str | None = None

    def sandbox(self) -> Sandbox:
        headers = {"E2b-Sandbox-Id": "envd-test", "E2b-Sandbox-Port": "49983"}
        if self.token:
            headers["X-Access-Token"] = self.token
        config = ConnectionConfig(sandbox_url=self.url, api_key="e2b_test", extra_sandbox_headers=headers)
        return Sandbox(
            sandbox_id="envd-test",
            sandbox_domain=None,
            envd_version=ENVD_VERSION,
            envd_access_token=self.token,
            traffic_access_token=None,
            connection_config=config,
        )

    def headers(self) -> dict[str, str]:
        return {"X-Access-Token": self.token} if self.token else {}


# These tests run envd on the host, so its commands are root's `bash -l` on the host. Where root's
# profile runs `pyenv rehash` (as on our machines), a command SIGKILLed mid-rehash leaves pyenv's lock
# file behind and every later login shell waits 60 s for it. Envd passes its environment on to the
# commands it starts: give up on a stale lock after 1 s instead.
os.environ.setdefault("PYENV_REHASH_TIMEOUT", "1")


def _start_envd(env_extra: dict[str, str] | None = None) -> Envd:
    port = _free_port()
    env = {**os.environ, **(env_extra or {})}
    token = env_extra.get("FORKYARD_ENVD_ACCESS_TOKEN") if env_extra else None
    log = Path(tempfile.mkstemp(prefix="envd-test-log-")[1])
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forkyard.envd", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = started + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envd exited with {proc.returncode}: {log.read_text()}")
        if _healthy(url):
            return Envd(url, proc, time.monotonic() - started, log, token)
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"envd did not answer /health within 20 s: {log.read_text()}")


def _stop_envd(envd: Envd) -> str:
    """Stop envd and return what it logged (tracebacks there mean a handler crashed)."""
    envd.proc.send_signal(signal.SIGTERM)
    try:
        envd.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        envd.proc.kill()
        envd.proc.wait()
    text = envd.log.read_text(errors="replace")
    envd.log.unlink(missing_ok=True)
    return text


@pytest.fixture(scope="module")
def envd() -> Iterator[Envd]:
    server = _start_envd()
    print(f"\nenvd start-up (spawn to first /health 204): {server.startup_seconds * 1000:.0f} ms")
    yield server
    log = _stop_envd(server)
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def sbx(envd: Envd) -> Sandbox:
    return envd.sandbox()


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="envd-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- commands ------------------------------------------------------------------------------------
def test_health(envd: Envd) -> None:
    assert httpx.get(f"{envd.url}/health").status_code == 204


def test_run_collects_stdout_stderr_and_exit_code(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo out; echo err >&2; whoami")
    assert result.stdout == "out\nroot\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0


def test_nonzero_exit_raises_with_code_and_output(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo bad >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stderr == "bad\n"
    assert info.value.error == "exit status 7"


def test_on_stdout_callbacks_stream_in_order(sbx: Sandbox) -> None:
    seen_out: list[str] = []
    seen_err: list[str] = []
    sbx.commands.run(
        "for i in 1 2 3; do echo $i; sleep 0.05; done; echo e >&2",
        on_stdout=seen_out.append,
        on_stderr=seen_err.append,
    )
    assert "".join(seen_out) == "1\n2\n3\n"
    assert "".join(seen_err) == "e\n"


def test_envs_cwd_and_user(sbx: Sandbox, workdir: str) -> None:
    result = sbx.commands.run("echo $FOO; pwd; echo $HOME $USER", envs={"FOO": "bar baz"}, cwd=workdir)
    assert result.stdout == f"bar baz\n{workdir}\n/root root\n"
    as_nobody = sbx.commands.run("id -un; echo $USER", user="nobody", cwd="/tmp")  # type: ignore[arg-type]
    assert as_nobody.stdout == "nobody\nnobody\n"


def test_unknown_user_is_a_clear_error(sbx: Sandbox) -> None:
    with pytest.raises(AuthenticationException, match="unknown user no-such-user-envd"):
        sbx.commands.run("true", user="no-such-user-envd")  # type: ignore[arg-type]


def test_missing_cwd_is_invalid_argument(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException, match="does not exist"):
        sbx.commands.run("true", cwd="/nonexistent/envd-test")


def test_background_list_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 30", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].cmd == "/bin/bash"
    assert listed[handle.pid].args == ["-l", "-c", "sleep 30"]
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"
    assert sbx.commands.kill(handle.pid) is False  # gone: NOT_FOUND maps to False


def test_closing_the_start_stream_does_not_kill_and_many_clients_attach(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 1; echo done", background=True)
    handle.disconnect()
    time.sleep(0.2)
    assert handle.pid in {p.pid for p in sbx.commands.list()}
    first = sbx.commands.connect(handle.pid)
    second = sbx.commands.connect(handle.pid)
    results: dict[str, str] = {}

    def wait(name: str, h: object) -> None:
        try:
            results[name] = h.wait().stdout  # type: ignore[attr-defined]
        except Exception as exc:  # reported by the assertion below
            results[name] = repr(exc)

    threads = [threading.Thread(target=wait, args=(n, h)) for n, h in (("a", first), ("b", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # bash -l can take seconds on a loaded machine or under gVisor
    assert results == {"a": "done\n", "b": "done\n"}


def test_stdin_send_and_close(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat; echo EOF", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "hello ")
    sbx.commands.stream_input(handle.pid, [b"stream", "ed\n"])
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello streamed\nEOF\n"


def test_stdin_disabled_by_default(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat; echo closed", background=True)
    assert handle.wait().stdout == "closed\n"  # stdin is /dev/null: cat ends at once
    handle = sbx.commands.run("sleep 5", background=True)
    try:
        with pytest.raises(SandboxException, match="not enabled"):
            sbx.commands.send_stdin(handle.pid, "x")
    finally:
        handle.kill()


def test_unknown_pid_is_not_found(sbx: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        sbx.commands.send_stdin(4_000_000, "x")
    with pytest.raises(NotFoundException):
        sbx.commands.connect(4_000_000)


def test_pty_create_input_resize_kill(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "$ "})
    output = bytearray()
    done = threading.Event()

    def collect() -> None:
        try:
            handle.wait(on_pty=output.extend)
        except CommandExitException:
            pass
        done.set()

    threading.Thread(target=collect, daemon=True).start()
    sbx.pty.send_stdin(handle.pid, b"tty; stty size\n")
    _wait_for(lambda: b"24 80" in output)
    assert b"/dev/pts/" in output
    sbx.pty.resize(handle.pid, PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(handle.pid, b"stty size\n")
    _wait_for(lambda: b"40 100" in output)
    assert sbx.pty.kill(handle.pid) is True
    assert done.wait(10)


def test_pty_exit_via_input(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=10, cols=40))
    sbx.pty.send_stdin(handle.pid, b"exit 3\n")
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == 3


def _wait_for(condition: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


# --- files ---------------------------------------------------------------------------------------
def test_files_write_read_list_exists_rename_remove(sbx: Sandbox, workdir: str) -> None:
    info = sbx.files.write(f"{workdir}/a/b/c.txt", "hello")
    assert (info.path, info.name) == (f"{workdir}/a/b/c.txt", "c.txt")
    assert sbx.files.read(f"{workdir}/a/b/c.txt") == "hello"
    assert sbx.files.read(f"{workdir}/a/b/c.txt", format="bytes") == bytearray(b"hello")
    assert sbx.files.exists(f"{workdir}/a/b/c.txt")
    assert not sbx.files.exists(f"{workdir}/missing")
    assert sbx.files.make_dir(f"{workdir}/d/e") is True
    assert sbx.files.make_dir(f"{workdir}/d/e") is False  # ALREADY_EXISTS
    moved = sbx.files.rename(f"{workdir}/a/b/c.txt", f"{workdir}/d/e/moved.txt")
    assert moved.path == f"{workdir}/d/e/moved.txt" and moved.size == 5
    names = [(e.name, e.type.value if e.type else None) for e in sbx.files.list(workdir)]
    assert names == [("a", "dir"), ("d", "dir")]
    deep = [e.path for e in sbx.files.list(workdir, depth=3)]
    assert deep == [f"{workdir}/{p}" for p in ("a", "a/b", "d", "d/e", "d/e/moved.txt")]
    sbx.files.remove(f"{workdir}/d")
    assert not sbx.files.exists(f"{workdir}/d")


def test_entry_info_fields(sbx: Sandbox, workdir: str) -> None:
    path = f"{workdir}/f.sh"
    sbx.files.write(path, "#!/bin/sh\n")
    os.chmod(path, 0o754)
    os.symlink(path, f"{workdir}/link")
    info = sbx.files.get_info(path)
    assert (info.mode, info.permissions, info.size) == (0o754, "-rwxr-xr--", 10)
    assert (info.owner, info.group) == ("root", "root")
    assert abs(info.modified_time.timestamp() - os.stat(path).st_mtime) < 1
    link = sbx.files.get_info(f"{workdir}/link")
    # E2B's envd reports the target's type and the resolved target.
    assert link.type is not None and link.type.value == "file"
    assert link.symlink_target == path
    assert sbx.files.get_info(workdir).permissions.startswith("d")


def test_relative_paths_resolve_against_home(sbx: Sandbox) -> None:
    name = f"envd-test-{uuid.uuid4().hex}.txt"
    try:
        info = sbx.files.write(name, "x")
        assert info.path == f"/root/{name}"
        assert sbx.commands.run(f"cat {name}").stdout == "x"
    finally:
        Path(f"/root/{name}").unlink(missing_ok=True)


def test_write_as_user_chowns(sbx: Sandbox, workdir: str) -> None:
    os.chmod(workdir, 0o777)
    sbx.files.write(f"{workdir}/new/owned.txt", "x", user="nobody")  # type: ignore[arg-type]
    info = sbx.files.get_info(f"{workdir}/new/owned.txt")
    assert info.owner == "nobody"
    assert sbx.files.get_info(f"{workdir}/new").owner == "nobody"


def test_missing_file_and_directory_errors(sbx: Sandbox, envd: Envd, workdir: str) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{workdir}/nope.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.list(f"{workdir}/nope")
    sbx.files.remove(f"{workdir}/nope")  # idempotent, like E2B's envd (os.RemoveAll)
    resp = httpx.get(f"{envd.url}/files", params={"path": f"{workdir}/nope.txt"})
    assert resp.status_code == 404
    assert resp.json() == {"code": 404, "message": f"path '{workdir}/nope.txt' does not exist"}
    resp = httpx.get(f"{envd.url}/files", params={"path": workdir})
    assert resp.status_code == 400
    assert resp.json() == {"code": 400, "message": f"path '{workdir}' is a directory"}
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(workdir)
    resp = httpx.get(f"{envd.url}/files", params={"path": "/etc/hostname", "username": "no-such-user-envd"})
    assert resp.status_code == 401 and "unknown user" in resp.json()["message"]


def test_upload_to_directory_path_is_rejected(sbx: Sandbox, workdir: str) -> None:
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sbx.files.write(workdir, "x")


def test_write_files_multipart_many(sbx: Sandbox, workdir: str) -> None:
    infos = sbx.files.write_files(
        [
            {"path": f"{workdir}/m1.txt", "data": "one"},
            {"path": f"{workdir}/sub/m2.bin", "data": b"\x00\x01"},
            {"path": f"{workdir}/ünï cödé.txt", "data": "ü"},
        ]
    )
    assert [i.path for i in infos] == [f"{workdir}/{n}" for n in ("m1.txt", "sub/m2.bin", "ünï cödé.txt")]
    assert sbx.files.read(f"{workdir}/ünï cödé.txt") == "ü"
    assert Path(f"{workdir}/m1.txt").read_text() == "one"
    assert Path(f"{workdir}/sub/m2.bin").read_bytes() == b"\x00\x01"


def test_octet_stream_gzip_and_metadata(sbx: Sandbox, workdir: str) -> None:
    path = f"{workdir}/meta.txt"
    info = sbx.files.write(path, "zipped", gzip=True, metadata={"Purpose": "test", "run": "1"})
    assert Path(path).read_text() == "zipped"
    assert info.metadata == {"purpose": "test", "run": "1"}
    assert sbx.files.get_info(path).metadata == {"purpose": "test", "run": "1"}
    sbx.files.write(path, "again", use_octet_stream=True)  # no metadata headers: metadata cleared
    assert sbx.files.get_info(path).metadata is None
    assert sbx.files.read(path, gzip=True) == "again"


def test_large_upload_and_download_are_intact(sbx: Sandbox, workdir: str) -> None:
    size = 50 * 1024 * 1024
    payload = os.urandom(1024 * 1024) * 50
    digest = hashlib.sha256(payload).hexdigest()
    path = f"{workdir}/big.bin"
    sbx.files.write(path, io.BytesIO(payload))  # file-like: streamed octet-stream upload
    assert os.path.getsize(path) == size
    hasher = hashlib.sha256()
    with sbx.files.read(path, format="stream") as stream:
        for chunk in stream:
            hasher.update(chunk)
    assert hasher.hexdigest() == digest
    sbx.files.write(f"{workdir}/big2.bin", payload, use_octet_stream=False)  # multipart
    assert hashlib.sha256(Path(f"{workdir}/big2.bin").read_bytes()).hexdigest() == digest
    assert sorted(os.listdir(workdir)) == ["big.bin", "big2.bin"]  # no temp files left


def test_failed_upload_leaves_no_partial_file(envd: Envd, workdir: str) -> None:
    Path(f"{workdir}/keep.txt").write_text("original")
    broken = gzip.compress(b"x" * 100_000)[:-20]
    resp = httpx.post(
        f"{envd.url}/files",
        params={"path": f"{workdir}/keep.txt"},
        content=broken,
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert resp.status_code == 400 and resp.json()["code"] == 400
    assert Path(f"{workdir}/keep.txt").read_text() == "original"
    assert os.listdir(workdir) == ["keep.txt"]


def test_watch_dir_events(sbx: Sandbox, workdir: str) -> None:
    handle = sbx.files.watch_dir(workdir, recursive=True, include_entry=True)

    def events_until(name: str, kind: FilesystemEventType) -> list[FilesystemEvent]:
        got: list[FilesystemEvent] = []

        def arrived() -> bool:
            got.extend(handle.get_new_events())
            return any((e.name, e.type) == (name, kind) for e in got)

        _wait_for(arrived)
        time.sleep(0.1)  # anything that would wrongly follow
        return got + handle.get_new_events()

    try:
        sbx.files.write(f"{workdir}/w.txt", "1")
        first = events_until("w.txt", FilesystemEventType.WRITE)
        sbx.files.write(f"{workdir}/w.txt", "overwritten")
        overwrite = events_until("w.txt", FilesystemEventType.WRITE)
        sbx.files.make_dir(f"{workdir}/sub")
        events = events_until("sub", FilesystemEventType.CREATE)  # now watched too
        sbx.files.write(f"{workdir}/sub/deep.txt", "2")
        events += events_until("sub/deep.txt", FilesystemEventType.WRITE)
        sbx.files.remove(f"{workdir}/w.txt")
        events += events_until("w.txt", FilesystemEventType.REMOVE)
    finally:
        handle.stop()
    # An upload reads like E2B's in-place write (create, chown, write); its temp file never shows.
    assert [(e.name, e.type) for e in first] == [
        ("w.txt", FilesystemEventType.CREATE),
        ("w.txt", FilesystemEventType.CHMOD),
        ("w.txt", FilesystemEventType.WRITE),
    ]
    assert [(e.name, e.type) for e in overwrite] == [
        ("w.txt", FilesystemEventType.CHMOD),
        ("w.txt", FilesystemEventType.WRITE),
    ]
    seen = {(e.name, e.type) for e in events}
    assert ("sub", FilesystemEventType.CREATE) in seen
    assert ("sub/deep.txt", FilesystemEventType.CREATE) in seen
    assert ("w.txt", FilesystemEventType.REMOVE) in seen
    assert any(e.entry is not None and e.entry.path == f"{workdir}/sub" for e in events)


def test_watch_dir_stream_over_connect(envd: Envd, workdir: str) -> None:
    client = filesystem_connect.FilesystemClientSync(envd.url, codec=ENVD_JSON_CODEC)
    stream = as_stream(
        client.watch_dir(
            filesystem_pb.WatchDirRequest(path=workdir),
            headers={"Keepalive-Ping-Interval": "1"},
            timeout_ms=10_000,
        )
    )
    try:
        first = next(stream)
        assert first.event is not None and first.event.field == "start"
        Path(f"{workdir}/s.txt").write_text("x")
        kinds = []
        for message in stream:  # create, write, then quiet: a keepalive each second
            assert message.event is not None
            kinds.append(message.event.field)
            if message.event.field == "filesystem":
                assert message.event.value.name == "s.txt"  # type: ignore[union-attr]
            if message.event.field == "keepalive":
                break
        assert kinds[0] == "filesystem" and kinds[-1] == "keepalive"
    finally:
        stream.close()


def test_watch_errors(sbx: Sandbox, workdir: str) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir(f"{workdir}/nope")
    Path(f"{workdir}/file").write_text("x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.watch_dir(f"{workdir}/file")


@contextlib.contextmanager
def _inotify_queue_limit(events: int) -> Iterator[None]:
    """Inotify instances created inside (the kernel reads the limit at inotify_init) queue at most
    ``events`` unread events; the host's limit is back once the watcher exists."""
    knob = Path("/proc/sys/fs/inotify/max_queued_events")
    before = knob.read_text()
    knob.write_text(str(events))
    try:
        yield
    finally:
        knob.write_text(before)


@contextlib.contextmanager
def _frozen(envd: Envd) -> Iterator[None]:
    """envd does not run inside, so the kernel queues the events its watchers would have read."""
    envd.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        envd.proc.send_signal(signal.SIGCONT)


def _create_files(directory: str, count: int) -> None:
    for i in range(count):  # distinct names: the kernel coalesces only identical events
        Path(f"{directory}/f{i}").touch()


def test_polled_watcher_that_lost_events_fails(envd: Envd, sbx: Sandbox, workdir: str) -> None:
    """The kernel's queue overflows while envd does not read it: GetWatcherEvents fails from then
    on, as E2B's envd answers fsnotify's ErrEventOverflow, instead of handing out what was left."""
    with _inotify_queue_limit(64):
        handle = sbx.files.watch_dir(workdir)
    try:
        with _frozen(envd):
            _create_files(workdir, 500)

        def failed() -> bool:
            try:
                handle.get_new_events()
            except SandboxException as exc:
                assert "queue or buffer overflow" in str(exc)
                return True
            return False

        _wait_for(failed)
        with pytest.raises(SandboxException, match="queue or buffer overflow"):
            handle.get_new_events()  # until the watcher is removed
    finally:
        handle.stop()


def test_watch_dir_stream_that_lost_events_ends_with_the_error(envd: Envd, workdir: str) -> None:
    client = filesystem_connect.FilesystemClientSync(envd.url, codec=ENVD_JSON_CODEC)
    with _inotify_queue_limit(64):
        stream = as_stream(
            client.watch_dir(
                filesystem_pb.WatchDirRequest(path=workdir),
                headers={"Keepalive-Ping-Interval": "1"},
                timeout_ms=20_000,
            )
        )
        first = next(stream)  # sent once the watcher exists
    try:
        assert first.event is not None and first.event.field == "start"
        with _frozen(envd):
            _create_files(workdir, 500)
        delivered = 0
        with pytest.raises(ConnectError) as info:
            for message in stream:
                assert message.event is not None
                if message.event.field == "keepalive":
                    break  # quiet after the events: the loss went unreported
                delivered += 1
        assert info.value.code == Code.INTERNAL
        assert info.value.message == "watcher error: fsnotify: queue or buffer overflow"
        assert delivered <= 64  # what the kernel had queued before the loss, then the error
    finally:
        stream.close()


# --- wire-level checks ---------------------------------------------------------------------------
def test_binary_proto_codec(envd: Envd) -> None:
    client = process_connect.ProcessClientSync(envd.url, codec=proto_binary_codec())
    stream = client.start(
        process_pb.StartRequest(process=process_pb.ProcessConfig(cmd="/bin/echo", args=["proto"])),
        timeout_ms=10_000,
    )
    fields = []
    output = b""
    for message in stream:
        assert message.event is not None and message.event.event is not None
        fields.append(message.event.event.field)
        if message.event.event.field == "data":
            output += message.event.event.value.output.value  # type: ignore[union-attr]
        if message.event.event.field == "end":
            assert message.event.event.value.exit_code == 0  # type: ignore[union-attr]
    assert fields[0] == "start" and fields[-1] == "end"
    assert output == b"proto\n"
    listed = client.list(process_pb.ListRequest())
    assert isinstance(listed, process_pb.ListResponse)
    unknown: Oneof[Literal["pid"], int] = Oneof("pid", 4_000_000)
    with pytest.raises(ConnectError) as info:
        client.send_signal(
            process_pb.SendSignalRequest(
                process=process_pb.ProcessSelector(selector=unknown),
                signal=process_pb.Signal.SIGKILL,
            )
        )
    assert info.value.code == Code.NOT_FOUND


def test_malformed_rpc_body_is_invalid_argument(envd: Envd) -> None:
    resp = httpx.post(
        f"{envd.url}/filesystem.Filesystem/Stat",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_argument"


def test_stat_over_json_unary(envd: Envd) -> None:
    resp = httpx.post(
        f"{envd.url}/filesystem.Filesystem/Stat",
        json={"path": "/etc/hostname"},
        headers={"Authorization": "Basic " + base64.b64encode(b"root:").decode()},
    )
    assert resp.status_code == 200
    assert resp.json()["entry"]["type"] == "FILE_TYPE_FILE"


def test_init_envs_metrics(envd: Envd, sbx: Sandbox, workdir: str) -> None:
    resp = httpx.post(f"{envd.url}/init", content=b"{oops")
    assert resp.status_code == 400 and resp.json()["code"] == 400
    resp = httpx.post(
        f"{envd.url}/init",
        json={"envVars": {"FROM_INIT": "yes", "FOO": "init"}, "timestamp": "2026-01-01T00:00:00Z"},
    )
    assert resp.status_code == 204
    assert httpx.get(f"{envd.url}/envs").json() == {"FROM_INIT": "yes", "FOO": "init"}
    result = sbx.commands.run("echo $FROM_INIT $FOO", envs={"FOO": "request"})
    assert result.stdout == "yes request\n"  # request envs win over /init's
    metrics = httpx.get(f"{envd.url}/metrics").json()
    assert set(metrics) == {
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    }
    assert metrics["mem_total"] > metrics["mem_used"] > 0 and metrics["disk_total"] > 0


# --- access token --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured_envd() -> Iterator[Envd]:
    server = _start_envd({"FORKYARD_ENVD_ACCESS_TOKEN": "tok-" + uuid.uuid4().hex})
    yield server
    log = _stop_envd(server)
    assert "Traceback" not in log, log


def test_access_token_required_except_health(secured_envd: Envd, workdir: str) -> None:
    url = secured_envd.url
    assert httpx.get(f"{url}/health").status_code == 204
    resp = httpx.get(f"{url}/files", params={"path": "/etc/hostname"})
    assert resp.status_code == 401 and resp.json()["code"] == 401
    # /envs is open to loopback peers (processes inside the sandbox, which hold these variables
    # anyway; the code interpreter's server reads them): this test's client is one.
    assert httpx.get(f"{url}/envs").status_code == 200
    resp = httpx.post(f"{url}/process.Process/List", json={}, headers={"Content-Type": "application/json"})
    assert resp.status_code == 401 and resp.json()["code"] == "unauthenticated"
    assert httpx.get(f"{url}/envs", headers=secured_envd.headers()).status_code == 200
    sbx = secured_envd.sandbox()
    assert sbx.commands.run("echo ok").stdout == "ok\n"
    sbx.files.write(f"{workdir}/t.txt", "secret")
    # Signed URL (v1 signature) instead of the header.
    signed = sbx.download_url(f"{workdir}/t.txt", use_signature_expiration=60)
    assert httpx.get(signed).text == "secret"
    tampered = signed.replace("t.txt", "x.txt")
    assert httpx.get(tampered).status_code == 401


def test_init_sets_the_token(envd: Envd) -> None:
    server = _start_envd()
    try:
        token = "tok-" + uuid.uuid4().hex
        assert httpx.post(f"{server.url}/init", json={"accessToken": token}).status_code == 204
        files = f"{server.url}/files?path=/etc/hostname"
        assert httpx.get(files).status_code == 401
        assert httpx.get(files, headers={"X-Access-Token": token}).status_code == 200
        assert httpx.post(f"{server.url}/init", json={}).status_code == 401  # now /init needs it too
    finally:
        _stop_envd(server)


def test_envd_startup_reports_env_port(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "FORKYARD_ENVD_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "forkyard.envd", "--host", "127.0.0.1"], cwd=REPO, env=env)
    try:
        _wait_for(lambda: _healthy(f"http://127.0.0.1:{port}"), timeout=20)
    finally:
        proc.terminate()
        proc.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 204
    except httpx.TransportError:
        return False


def test_json_is_what_the_sdk_sends(envd: Envd) -> None:
    """The SDK's JSON codec against our server: unary application/json."""
    client = process_connect.ProcessClientSync(envd.url, codec=ENVD_JSON_CODEC)
    assert json.loads(client.list(process_pb.ListRequest()).to_json() or "{}") is not None


def test_process_stream_keepalive_and_tag(envd: Envd) -> None:
    """Keepalives at the requested interval; Connect and SendSignal by tag."""
    client = process_connect.ProcessClientSync(envd.url, codec=ENVD_JSON_CODEC)
    tag = "tag-" + uuid.uuid4().hex
    stream = as_stream(
        client.start(
            process_pb.StartRequest(process=process_pb.ProcessConfig(cmd="/bin/sleep", args=["30"]), tag=tag),
            headers={"Keepalive-Ping-Interval": "1"},
            timeout_ms=20_000,
        )
    )
    try:
        start = next(stream)
        assert start.event is not None and start.event.event is not None
        assert start.event.event.field == "start"
        started = time.monotonic()
        keepalive = next(stream)
        assert keepalive.event is not None and keepalive.event.event is not None
        assert keepalive.event.event.field == "keepalive"
        assert 0.5 < time.monotonic() - started < 15  # 1 s asked; loaded CI machines lag
        listed = client.list(process_pb.ListRequest())
        assert [p.tag for p in listed.processes if p.tag == tag] == [tag]
        by_tag: Oneof[Literal["tag"], str] = Oneof("tag", tag)
        attached = as_stream(
            client.connect(process_pb.ConnectRequest(process=process_pb.ProcessSelector(selector=by_tag)))
        )
        first = next(attached)
        assert first.event is not None and first.event.event is not None
        assert first.event.event.value.pid == start.event.event.value.pid  # type: ignore[union-attr]
        client.send_signal(
            process_pb.SendSignalRequest(
                process=process_pb.ProcessSelector(selector=by_tag), signal=process_pb.Signal.SIGTERM
            )
        )
        ends = [m for m in attached if m.event and m.event.event and m.event.event.field == "end"]
        assert ends and ends[0].event.event.value.status == "signal: terminated"  # type: ignore[union-attr]
    finally:
        stream.close()


def test_init_default_user_and_workdir(workdir: str) -> None:
    server = _start_envd()
    try:
        os.chmod(workdir, 0o777)
        resp = httpx.post(f"{server.url}/init", json={"defaultUser": "nobody", "defaultWorkdir": workdir})
        assert resp.status_code == 204
        sbx = server.sandbox()
        assert sbx.commands.run("id -un; pwd").stdout == f"nobody\n{workdir}\n"
        info = sbx.files.write(f"{workdir}/by-default.txt", "x")
        assert sbx.files.get_info(info.path).owner == "nobody"
        assert sbx.is_running()
    finally:
        assert "Traceback" not in _stop_envd(server)


def test_watch_allows_network_mount_flag_on_local_dir(sbx: Sandbox, workdir: str) -> None:
    handle = sbx.files.watch_dir(workdir, allow_network_mounts=True)
    try:
        Path(f"{workdir}/n.txt").write_text("x")
        _wait_for(lambda: any(e.name == "n.txt" for e in handle.get_new_events()))
    finally:
        handle.stop()


def test_unknown_route_answers_e2b_error(envd: Envd) -> None:
    resp = httpx.get(f"{envd.url}/nope")
    assert resp.status_code == 404 and resp.json()["code"] == 404
    resp = httpx.delete(f"{envd.url}/files")
    assert resp.status_code == 405 and resp.json()["code"] == 405


def test_upload_through_symlink_writes_the_target(sbx: Sandbox, workdir: str) -> None:
    Path(f"{workdir}/real.txt").write_text("old")
    os.symlink(f"{workdir}/real.txt", f"{workdir}/alias.txt")
    info = sbx.files.write(f"{workdir}/alias.txt", "new")
    assert info.path == f"{workdir}/real.txt"
    assert os.path.islink(f"{workdir}/alias.txt") and Path(f"{workdir}/real.txt").read_text() == "new"


def test_download_encoding_negotiation(envd: Envd, workdir: str) -> None:
    Path(f"{workdir}/z.txt").write_text("z" * 10_000)
    url, params = f"{envd.url}/files", {"path": f"{workdir}/z.txt"}
    plain = httpx.get(url, params=params, headers={"Accept-Encoding": "gzip, deflate"})
    assert "content-encoding" not in plain.headers and plain.text == "z" * 10_000
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.headers["content-disposition"] == 'inline; filename="z.txt"'
    zipped = httpx.get(url, params=params, headers={"Accept-Encoding": "gzip"})
    assert zipped.headers["content-encoding"] == "gzip" and zipped.text == "z" * 10_000
    refused = httpx.get(url, params=params, headers={"Accept-Encoding": "br, identity;q=0"})
    assert refused.status_code == 406 and refused.json()["code"] == 406


def test_cors_preflight_needs_no_token(secured_envd: Envd) -> None:
    resp = httpx.options(
        f"{secured_envd.url}/process.Process/Start",
        headers={"Origin": "http://example.test", "Access-Control-Request-Method": "POST"},
    )
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"


def test_full_disk_upload_is_507_and_leaves_nothing(sbx: Sandbox, workdir: str) -> None:
    mount_point = f"{workdir}/small"
    os.mkdir(mount_point)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "envd-test-tmpfs", mount_point], check=True)
    try:
        Path(f"{mount_point}/keep.bin").write_bytes(b"k" * 1000)
        with pytest.raises(SandboxException, match="not enough disk space"):
            sbx.files.write(f"{mount_point}/keep.bin", os.urandom(2 * 1024 * 1024))
        assert os.listdir(mount_point) == ["keep.bin"]
        assert Path(f"{mount_point}/keep.bin").read_bytes() == b"k" * 1000
    finally:
        subprocess.run(["umount", mount_point], check=True)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_orphans_are_reaped_when_envd_is_pid_1() -> None:
    """In a sandbox envd is init: orphaned grandchildren must not pile up as zombies."""
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="envd-test-log-")[1])
    with log.open("wb") as out:
        unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]
        envd_cmd = [sys.executable, "-m", "forkyard.envd", "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(unshare + envd_cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    server = Envd(f"http://127.0.0.1:{port}", proc, 0.0, log)
    try:
        _wait_for(lambda: _healthy(server.url), timeout=20)
        sbx = server.sandbox()
        assert sbx.commands.run("echo $$ $PPID; cat /proc/1/cmdline | tr '\\0' ' '").stdout.split()[1] == "1"
        sbx.commands.run("for i in 1 2 3; do (sleep 0.1 &) ; done; true")
        count = "grep -l '^[0-9]* ([^)]*) Z' /proc/[0-9]*/stat 2>/dev/null | wc -l"
        _wait_for(lambda: sbx.commands.run(count).stdout.strip() == "0", timeout=10)
    finally:
        # unshare does not pass SIGTERM on: stop envd (its only child) directly.
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                os.kill(int(child), signal.SIGTERM)
        assert "Traceback" not in _stop_envd(server)


JS_SDK = REPO / "tests" / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"
JS_SMOKE = """
import { Sandbox } from '%(sdk)s'
const [url, dir] = process.argv.slice(2)
const sbx = new Sandbox({ sandboxId: 'js', sandboxUrl: url, envdVersion: '0.6.4', apiKey: 'e2b_js' })
const out = {}
const r = await sbx.commands.run('echo js-hi; echo e >&2')
out.run = [r.stdout, r.stderr, r.exitCode]
try { await sbx.commands.run('exit 4') } catch (e) { out.exit = e.exitCode }
const events = []
const watcher = await sbx.files.watchDir(dir, (ev) => events.push([ev.name, ev.type]))
await sbx.files.write(dir + '/f.txt', 'hello js')
await new Promise((resolve) => setTimeout(resolve, 500))
await watcher.stop()
out.events = events
out.read = await sbx.files.read(dir + '/f.txt')
const h = await sbx.commands.run('sleep 20', { background: true })
out.killed = await sbx.commands.kill(h.pid)
let screen = ''
const onData = (d) => { screen += new TextDecoder().decode(d) }
const pty = await sbx.pty.create({ cols: 80, rows: 24, onData })
await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit\\n'))
await pty.wait().catch(() => {})
out.pty = screen.includes('24 80')
console.log(JSON.stringify(out))
"""


@pytest.mark.skipif(
    shutil.which("node") is None or not JS_SDK.exists(), reason="needs node and tests/js deps"
)
def test_js_sdk_against_envd(envd: Envd, workdir: str) -> None:
    """The npm SDK streams WatchDir over connect+json (the Python SDK polls a watcher instead)."""
    script = Path(workdir) / "smoke.mjs"
    script.write_text(JS_SMOKE % {"sdk": JS_SDK})
    done = subprocess.run(
        ["node", str(script), envd.url, workdir], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["run"] == ["js-hi\n", "e\n", 0]
    assert out["exit"] == 4
    assert out["events"] == [["f.txt", "create"], ["f.txt", "chmod"], ["f.txt", "write"]]
    assert out["read"] == "hello js"
    assert out["killed"] is True and out["pty"] is True


def test_files_compose(envd: Envd, workdir: str) -> None:
    for name, data in (("p1", b"abc"), ("p2", b"def"), ("p3", b"g")):
        Path(f"{workdir}/{name}").write_bytes(data)
    resp = httpx.post(
        f"{envd.url}/files/compose",
        json={
            "source_paths": [f"{workdir}/p1", f"{workdir}/p2", f"{workdir}/p3"],
            "destination": f"{workdir}/out/all",
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"name": "all", "type": "file", "path": f"{workdir}/out/all"}
    assert Path(f"{workdir}/out/all").read_bytes() == b"abcdefg"
    assert sorted(os.listdir(workdir)) == ["out"]  # sources deleted
    missing = httpx.post(
        f"{envd.url}/files/compose", json={"source_paths": [f"{workdir}/nope"], "destination": f"{workdir}/x"}
    )
    assert missing.status_code == 404 and missing.json()["code"] == 404
    bad = httpx.post(f"{envd.url}/files/compose", content=b"[1")
    assert bad.status_code == 400 and bad.json()["code"] == 400


def test_large_transfers_are_not_held_in_memory(workdir: str) -> None:
    """A fresh envd's peak RSS must not grow by the size of 50 MiB uploads and downloads."""
    server = _start_envd()
    try:
        sbx = server.sandbox()

        def peak_rss_kib() -> int:
            status = Path(f"/proc/{server.proc.pid}/status").read_text()
            peak = [line for line in status.splitlines() if line.startswith("VmHWM:")]
            if not peak:
                pytest.skip("this kernel's /proc has no VmHWM (gVisor)")
            return int(peak[0].split()[1])

        sbx.files.write(f"{workdir}/warm.bin", b"w" * 1024)
        before = peak_rss_kib()

        def chunks() -> Iterator[bytes]:
            block = os.urandom(1024 * 1024)
            for _ in range(50):
                yield block

        sbx.files.write(f"{workdir}/streamed.bin", chunks())  # octet-stream
        sbx.files.write(f"{workdir}/multipart.bin", os.urandom(50 * 1024 * 1024), use_octet_stream=False)
        with sbx.files.read(f"{workdir}/multipart.bin", format="stream") as stream:
            assert sum(len(chunk) for chunk in stream) == 50 * 1024 * 1024
        assert os.path.getsize(f"{workdir}/streamed.bin") == 50 * 1024 * 1024
        assert peak_rss_kib() - before < 20 * 1024
    finally:
        assert "Traceback" not in _stop_envd(server)


def _envd_in_mount_namespace(binds: dict[Path, str], log: Path) -> Envd:
    """envd in a private mount namespace of its own, with ``binds`` (host file -> path) mounted
    over the host's files: another /etc/passwd, profile, ... without touching the host."""
    port = _free_port()
    mounts = [f"mount --bind {source} {target}" for source, target in binds.items()]
    script = " && ".join([*mounts, f"exec {sys.executable} -m forkyard.envd --host 127.0.0.1 --port {port}"])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return Envd(f"http://127.0.0.1:{port}", proc, 0.0, log)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_default_user_is_user_when_the_template_has_one(tmp_path: Path) -> None:
    """Like an E2B template: a ``user`` account exists, so it is the default (private mount ns)."""
    # Not below tmp_path: pytest's /tmp/pytest-of-root is root's alone (0700), and envd writes
    # files with the user's rights (docs/HARDENING.md), so the user must be able to reach home.
    home = Path(tempfile.mkdtemp(prefix="envd-home-user-"))
    os.chown(home, 61000, 61000)
    passwd, group = tmp_path / "passwd", tmp_path / "group"
    passwd.write_text(Path("/etc/passwd").read_text() + f"user:x:61000:61000::{home}:/bin/bash\n")
    group.write_text(Path("/etc/group").read_text() + "user:x:61000:\n")
    server = _envd_in_mount_namespace({passwd: "/etc/passwd", group: "/etc/group"}, tmp_path / "envd.log")
    try:
        _wait_for(lambda: _healthy(server.url), timeout=20)
        sbx = server.sandbox()
        result = sbx.commands.run("id -un; pwd; echo $HOME $USER")
        assert result.stdout == f"user\n{home}\n{home} user\n"
        info = sbx.files.write("relative.txt", "mine")
        assert info.path == f"{home}/relative.txt"
        assert sbx.files.get_info("relative.txt").owner == "user"
        assert sbx.commands.run("whoami", user="root").stdout == "root\n"  # type: ignore[arg-type]
    finally:
        log_text = _stop_envd(server)
        shutil.rmtree(home, ignore_errors=True)
        assert "Traceback" not in log_text


def test_envd_imports_stay_lean() -> None:
    """envd runs from the read-only in-sandbox bundle: none of the control plane's stack."""
    probe = (
        "import sys, forkyard.envd.server\n"
        "heavy = ('pydantic', 'pydantic_settings', 'fastapi', 'httpx', 'typer', 'aiosqlite')\n"
        "print([m for m in sys.modules if m.split('.')[0] in heavy or m.startswith('forkyard.config')])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_running_envd_maps_no_unused_libraries(envd: Envd) -> None:
    """Every mapped library and imported module is in each checkpoint image (forkyard.envd.lean):
    the running envd has neither pyqwest (connectrpc's HTTP client) nor websockets mapped; at
    start-up no ctypes (loaded on the first watch; this module's envd has watched already) and
    none of uvicorn's command line and process supervisors."""
    maps = Path(f"/proc/{envd.proc.pid}/maps").read_text()
    for library in ("_pyqwest", "websockets"):
        assert library not in maps, library
    probe = (
        "import sys\n"
        "from forkyard.envd import lean\n"
        "lean.defer_http_client()\n"
        "lean.uvicorn_server()\n"
        "import forkyard.envd.http.app, uvicorn.lifespan.on, uvicorn.protocols.http.h11_impl\n"
        "unused = ('pyqwest._pyqwest', 'click', 'multiprocessing', 'uvicorn.main', 'websockets', 'ctypes')\n"
        "print([m for m in unused if m in sys.modules])\n"
        # Deferred, not removed: whoever really uses them gets the real modules.
        "import pyqwest, uvicorn\n"
        "assert pyqwest.Headers().__class__.__module__.startswith('pyqwest'), pyqwest.Headers\n"
        "assert callable(uvicorn.run) and 'uvicorn.main' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_envd_reports_the_version_of_the_contract() -> None:
    from forkyard import types

    done = subprocess.run(
        [sys.executable, "-m", "forkyard.envd", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == types.ENVD_VERSION
    assert Version(types.ENVD_VERSION) == ENVD_VERSION  # what these tests tell the SDK


def test_bundle_ships_what_envd_imports_of_the_project() -> None:
    """envd imports forkyard.types and forkyard.errors: the bundle ships (and hashes) them, and
    refuses to build when envd imports a project module it does not ship."""
    from forkyard.storage import envd_bundle

    package = envd_bundle.envd_source_dir().parent
    shipped = {str(path.relative_to(package)) for path in envd_bundle._bundled_sources()}
    assert {"__init__.py", "types.py", "errors.py", "envd/server.py"} <= shipped
    envd_bundle._check_project_imports([package / "types.py", package / "envd" / "http" / "app.py"])
    with pytest.raises(envd_bundle.BundleError, match=r"config\.py"):
        envd_bundle._check_project_imports([package / "config.py"])


def test_aborted_upload_leaves_no_partial_file(envd: Envd, workdir: str) -> None:
    """The client goes away mid-body: no target, no temp file."""
    port = int(envd.url.rsplit(":", 1)[1])
    target = urllib.parse.quote(f"{workdir}/half.bin")
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(
            f"POST /files?path={target} HTTP/1.1\r\nHost: envd\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 10000000\r\n\r\n".encode()
        )
        conn.sendall(b"x" * 3_000_000)
        time.sleep(0.3)
    _wait_for(lambda: os.listdir(workdir) == [], timeout=5)
    time.sleep(0.3)
    assert os.listdir(workdir) == []


def test_init_timestamp_never_moves_the_clock_unless_enabled(envd: Envd) -> None:
    # Default envd (as on a host): a timestamp a year off is accepted and the clock stays put.
    before = time.time()
    resp = httpx.post(f"{envd.url}/init", json={"timestamp": "2025-01-01T00:00:00Z"})
    assert resp.status_code == 204
    assert abs(time.time() - before) < 5


def test_sync_clock_steps_only_on_skew_and_tolerates_refusal() -> None:
    from forkyard.envd.http.app import sync_clock
    from forkyard.envd.settings import parse_settings

    calls: list[tuple[int, float]] = []
    assert sync_clock(time.time(), setter=lambda clock, t: calls.append((clock, t))) is False
    assert calls == []  # within tolerance: untouched
    target = time.time() - 3600
    assert sync_clock(target, setter=lambda clock, t: calls.append((clock, t))) is True
    assert calls == [(time.CLOCK_REALTIME, target)]

    def refuse(clock: int, t: float) -> None:
        raise PermissionError(1, "Operation not permitted")

    assert sync_clock(target, setter=refuse) is False
    assert parse_settings([]).sync_clock is False
    assert parse_settings(["--sync-clock"]).sync_clock is True


def _slow_connect_stream(url: str, path: str, message: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A Connect server stream read through a small socket buffer, 64 KiB every 5 ms (~13 MB/s):
    a genuinely slow client (the SDK's HTTP stack would read ahead into its own memory)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(message).encode()
    conn = h11.Connection(our_role=h11.CLIENT)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    headers = [
        ("Host", host),
        ("Content-Type", "application/connect+json"),
        ("Connect-Protocol-Version", "1"),
    ]
    envelope = struct.pack(">BI", 0, len(body)) + body
    request = h11.Request(
        method="POST", target=path, headers=[*headers, ("Content-Length", str(len(envelope)))]
    )
    sock.sendall(conn.send(request) + conn.send(h11.Data(data=envelope)) + conn.send(h11.EndOfMessage()))
    buffer = bytearray()
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                time.sleep(0.005)
                conn.receive_data(sock.recv(64 * 1024))
                continue
            if isinstance(event, h11.Data):
                buffer += event.data
                while len(buffer) >= 5:
                    flags, length = struct.unpack(">BI", buffer[:5])
                    if len(buffer) < 5 + length:
                        break
                    payload = json.loads(buffer[5 : 5 + length])
                    del buffer[: 5 + length]
                    if flags & 0x02:  # end-of-stream envelope
                        return
                    yield payload
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    finally:
        sock.close()


def test_slow_client_gets_all_output_without_envd_buffering_it() -> None:
    """Backpressure: a client reading slower than the process writes holds the process back
    (through its pipe) instead of envd queueing the whole output in memory."""
    server = _start_envd({"FORKYARD_ENVD_STREAM_BUFFER_MIB": "2"})
    try:
        status = Path(f"/proc/{server.proc.pid}/status")
        if "VmHWM:" not in status.read_text():
            pytest.skip("this kernel's /proc has no VmHWM (gVisor)")

        def peak_rss_kib() -> int:
            line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
            return int(line.split()[1])

        assert httpx.post(f"{server.url}/process.Process/List", json={}).status_code == 200  # warm up
        before = peak_rss_kib()
        size = 24_000_000
        start: dict[str, Any] = {"process": {"cmd": "/bin/sh", "args": ["-c", f"head -c {size} /dev/zero"]}}
        received, end = 0, None
        for message in _slow_connect_stream(server.url, "/process.Process/Start", start):
            event = message["event"]
            if "data" in event:
                received += len(base64.b64decode(event["data"]["stdout"]))
            elif "end" in event:
                end = event["end"]
        assert received == size and end == {"exited": True, "status": "exit status 0"}
        grown_kib = peak_rss_kib() - before
        print(f"envd peak RSS grew {grown_kib} KiB streaming {size} bytes to a slow client")
        assert grown_kib < size / 1024 / 3  # unbounded queueing grows it by about the output size
    finally:
        assert "Traceback" not in _stop_envd(server)


def test_unread_background_command_is_not_held_up(sbx: Sandbox) -> None:
    """A background handle nobody iterates yet: the process still runs to the end (its output
    waits in envd, within the per-stream buffer) and wait() later gets all of it."""
    handle = sbx.commands.run("head -c 8000000 /dev/zero | tr '\\0' x; echo fin >&2", background=True)
    _wait_for(lambda: handle.pid not in {p.pid for p in sbx.commands.list()}, timeout=20)
    result = handle.wait()
    assert len(result.stdout) == 8_000_000 and result.stderr == "fin\n"


def test_stalled_client_is_dropped_and_the_process_runs_on(workdir: str) -> None:
    server = _start_envd({"FORKYARD_ENVD_STREAM_BUFFER_MIB": "1"})
    try:
        marker = f"{workdir}/finished"
        body = json.dumps(
            {"process": {"cmd": "/bin/sh", "args": ["-c", f"head -c 20000000 /dev/zero; touch {marker}"]}}
        ).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            envelope = struct.pack(">BI", 0, len(body)) + body
            sock.sendall(
                b"POST /process.Process/Start HTTP/1.1\r\nHost: envd\r\n"
                b"Content-Type: application/connect+json\r\n"
                + f"Content-Length: {len(envelope)}\r\n\r\n".encode()
                + envelope
            )
            # Read nothing: the process must not wait for us longer than the stall limit (10 s).
            _wait_for(lambda: os.path.exists(marker), timeout=30)
            sock.settimeout(10)
            tail = b""
            while b"aborted" not in tail:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                tail = (tail + chunk)[-4096:]
        assert b'"aborted"' in tail and b"fell behind" in tail
    finally:
        assert "Traceback" not in _stop_envd(server)


# --- login environments (forkyard/envd/process/loginenv.py) ----------------------------------------------
# `commands.run` is `/bin/bash -l -c <cmd>`; envd runs the profile once per (user, cwd, env) and
# starts commands as `bash --login --noprofile -c` in its result. These tests pin that a command
# cannot tell: an envd in a private mount namespace with an account of its own and a Debian-like
# profile (`$(id -u)`, /etc/profile.d, ~/.profile's PATH additions). `stdin=True` commands always
# run the real `bash -l` (a profile could read stdin), which gives the reference to compare with.
LOGIN_UID = 61001
ETC_PROFILE = """\
if [ "$(id -u)" -eq 0 ]; then
  PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH
if [ -d /etc/profile.d ]; then
  for i in /etc/profile.d/*.sh; do
    if [ -r $i ]; then
      . $i
    fi
  done
  unset i
fi
"""
HOME_PROFILE = """\
if [ -d "$HOME/bin" ] ; then PATH="$HOME/bin:$PATH"; fi
if [ -d "$HOME/.local/bin" ] ; then PATH="$HOME/.local/bin:$PATH"; fi
export FROM_PROFILE="home-profile"
export DERIVED="derived-${FOO:-none}"
"""
#: What a command can observe of its shell and environment, minus what differs between any two
#: processes (pids, counters, clocks, the command string).
STATE_PROBE = (
    "env; declare -p | grep -Ev '^declare -[-a-zA-Z]* (BASHPID|BASH_ARGV0|BASH_COMMAND|"
    "BASH_EXECUTION_STRING|BASH_LINENO|BASH_SOURCE|BASH_ARGC|BASH_ARGV|EPOCHREALTIME|EPOCHSECONDS|"
    "LINENO|RANDOM|SRANDOM|SECONDS|PIPESTATUS|BASH_CMDS|_)='; declare -f; shopt -p; set +o; "
    'echo "$- $0 $# $SHLVL"; umask; ulimit -a; pwd; shopt login_shell'
)


@dataclass
class LoginEnvd:
    envd: Envd
    root: Path
    home: Path

    def sandbox(self) -> Sandbox:
        return self.envd.sandbox()

    def run(self, cmd: str, **kwargs: Any) -> str:
        return self.sandbox().commands.run(cmd, **kwargs).stdout

    def cold(self, cmd: str, **kwargs: Any) -> str:
        """Through the real `bash -l` (never served from a captured login)."""
        return self.run(cmd, stdin=True, **kwargs)

    def uses_captured_login(self, **kwargs: Any) -> bool:
        """Whether a command (after the key's second one) starts without the profile."""
        for _ in range(3):
            # In a substitution: as the last command, tr would be exec'd and read its own.
            cmdline = self.run("line=$(tr '\\0' ' ' < /proc/$$/cmdline); echo \"$line\"", **kwargs)
            if "--noprofile" in cmdline:
                return True
            time.sleep(0.3)  # the capture runs in the background after the second command
        return False

    def in_namespace(self, *argv: str) -> None:
        """Run in envd's mount namespace, behind envd's back (no inotify event reaches it)."""
        subprocess.run(["nsenter", "-t", str(self.envd.proc.pid), "-m", *argv], check=True)


@pytest.fixture(scope="module")
def login_envd() -> Iterator[LoginEnvd]:
    # Not under pytest's tmp_path: its parents are private to root, and the account must reach
    # its home (else its profile fails with permission denied, and nothing is captured).
    root = Path(tempfile.mkdtemp(prefix="envd-login-"))
    root.chmod(0o755)
    home = root / "home"
    (root / "profile.d").mkdir()
    home.mkdir()
    (home / ".profile").write_text(HOME_PROFILE)
    for path in (home, home / ".profile"):
        os.chown(path, LOGIN_UID, LOGIN_UID)
    (root / "profile").write_text(ETC_PROFILE)
    (root / "passwd").write_text(
        Path("/etc/passwd").read_text() + f"loginuser:x:{LOGIN_UID}:{LOGIN_UID}::{home}:/bin/bash\n"
    )
    (root / "group").write_text(Path("/etc/group").read_text() + f"loginuser:x:{LOGIN_UID}:\n")
    binds = {root / name: f"/etc/{name}" for name in ("passwd", "group", "profile", "profile.d")}
    server = _envd_in_mount_namespace(binds, root / "envd.log")
    try:
        _wait_for(lambda: _healthy(server.url), timeout=20)
        resp = httpx.post(
            f"{server.url}/init", json={"defaultUser": "loginuser", "envVars": {"FROM_INIT": "1"}}
        )
        assert resp.status_code == 204
        yield LoginEnvd(server, root, home)
    finally:
        log_text = _stop_envd(server)
        shutil.rmtree(root, ignore_errors=True)
        assert "Traceback" not in log_text, log_text


@pytest.mark.skipif(shutil.which("nsenter") is None, reason="needs util-linux unshare and nsenter")
def test_login_command_sees_exactly_what_bash_l_sees(login_envd: LoginEnvd, workdir: str) -> None:
    os.chmod(workdir, 0o777)
    assert login_envd.uses_captured_login()
    captured, cold = login_envd.run(STATE_PROBE), login_envd.cold(STATE_PROBE)
    assert captured == cold
    assert "FROM_PROFILE=home-profile" in captured and "FROM_INIT=1" in captured
    assert "PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games\n" in captured
    assert "login_shell    \ton" in captured
    # Per-command envs and cwd: the profile sees them (DERIVED), each combination its own login.
    for foo in ("x", "y"):
        kwargs: dict[str, Any] = {"envs": {"FOO": foo}, "cwd": workdir}
        assert login_envd.uses_captured_login(**kwargs)
        assert login_envd.run(STATE_PROBE, **kwargs) == login_envd.cold(STATE_PROBE, **kwargs)
        assert login_envd.run("echo $DERIVED; pwd", **kwargs) == f"derived-{foo}\n{workdir}\n"


def test_login_command_is_bash_c_of_its_own(login_envd: LoginEnvd) -> None:
    """A fresh process per command; bash's own -c parsing, exit statuses, exec of the last
    command (a signal kills the program itself), ~/.bash_logout on exit."""
    assert login_envd.uses_captured_login()
    sbx = login_envd.sandbox()
    pids = {sbx.commands.run("X=1; echo $$").stdout for _ in range(3)}
    assert len(pids) == 3
    assert sbx.commands.run('echo "${X-unset}"').stdout == "unset\n"
    failing = ("echo (", "exit 7", "kill -9 $$", "sh -c 'kill -SEGV $$'", "sleep 30 & kill -SEGV $!; wait $!")
    for script in failing:
        got, want = _failure(sbx, script), _failure(sbx, script, stdin=True)
        assert _outcome(got) == _outcome(want), script
    assert "bash: -c: line 1: syntax error" in _failure(sbx, "echo (").stderr
    assert _failure(sbx, "sh -c 'kill -SEGV $$'").error == "signal: segmentation fault"  # exec'd: not 139
    (login_envd.home / ".bash_logout").write_text("echo bye from logout\n")
    try:
        assert sbx.commands.run("echo hi; exit 0").stdout == "hi\nbye from logout\n"
    finally:
        (login_envd.home / ".bash_logout").unlink()


def _failure(sbx: Sandbox, script: str, **kwargs: Any) -> CommandExitException:
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run(script, **kwargs)
    return failed.value


def _outcome(failed: CommandExitException) -> tuple[object, ...]:
    """What a failed command reports, pids aside (bash names the job it reports on)."""
    return failed.exit_code, failed.error, failed.stdout, re.sub(r"\b\d+\b", "<n>", failed.stderr)


def test_login_command_kill_stdin_and_background(login_envd: LoginEnvd) -> None:
    assert login_envd.uses_captured_login()
    sbx = login_envd.sandbox()
    handle = sbx.commands.run("sleep 30", background=True)
    assert sbx.commands.kill(handle.pid)
    with pytest.raises(CommandExitException) as killed:
        handle.wait()
    assert killed.value.error == "signal: killed"
    with_stdin = sbx.commands.run(
        "read line; echo got $line; echo $FROM_PROFILE", background=True, stdin=True
    )
    sbx.commands.send_stdin(with_stdin.pid, "input\n")
    assert with_stdin.wait().stdout == "got input\nhome-profile\n"


def test_profile_changes_reach_the_next_command(login_envd: LoginEnvd) -> None:
    """A command that edits a startup file, or creates a directory the profile adds to PATH,
    is followed by commands that see the change (inotify drops the captured login)."""
    assert login_envd.uses_captured_login()
    sbx = login_envd.sandbox()
    home = login_envd.home
    try:
        sbx.commands.run("echo 'export EDITED=yes' >> ~/.profile")
        assert sbx.commands.run("echo $EDITED").stdout == "yes\n"
        sbx.commands.run("mkdir -p ~/.local/bin")
        assert sbx.commands.run("echo $PATH").stdout.startswith(f"{home}/.local/bin:")
        sbx.files.write("/etc/profile.d/zz-test.sh", "export FROM_PROFILE_D=1\n", user="root")
        assert sbx.commands.run("echo $FROM_PROFILE_D").stdout == "1\n"
        assert login_envd.uses_captured_login()
        assert login_envd.run(STATE_PROBE) == login_envd.cold(STATE_PROBE)
    finally:
        (home / ".profile").write_text(HOME_PROFILE)
        shutil.rmtree(home / ".local", ignore_errors=True)
        (login_envd.root / "profile.d" / "zz-test.sh").unlink(missing_ok=True)


def test_logins_are_per_user(login_envd: LoginEnvd) -> None:
    """Each user gets their own login (root's: the profile's uid-0 branch and root's ~/.profile,
    which on a host may well define functions and so is not captured at all)."""
    probe = "id -un; echo ${FROM_PROFILE-none}; " + STATE_PROBE
    for _ in range(3):
        as_root, as_user = login_envd.run(probe, user="root"), login_envd.run(probe)
        assert as_root == login_envd.cold(probe, user="root")
        assert as_user == login_envd.cold(probe)
        assert as_root.startswith("root\nnone\n") and "/usr/local/sbin:" in as_root
        assert as_user.startswith("loginuser\nhome-profile\n") and "/usr/local/sbin" not in as_user


def test_profile_with_output_or_state_is_not_captured(login_envd: LoginEnvd) -> None:
    """Output of the profile is part of each command's output; a function it defines is
    visible to the command: such logins are run for every command, as before."""
    home = login_envd.home
    try:
        with (home / ".profile").open("a") as profile:
            profile.write("echo welcome\nhelper() { echo helped; }\n")
        sbx = login_envd.sandbox()
        for _ in range(3):
            assert sbx.commands.run("helper").stdout == "welcome\nhelped\n"
        assert not login_envd.uses_captured_login()
    finally:
        (home / ".profile").write_text(HOME_PROFILE)
    assert login_envd.uses_captured_login()


def test_init_keeps_captured_logins_only_while_nothing_changed(login_envd: LoginEnvd) -> None:
    """/init follows every restore, resume and fork: a login captured before it is used after it
    (a template snapshot's), unless what it read changed, even without envd seeing the change
    (a restored disk, here a mount behind envd's back)."""
    assert login_envd.uses_captured_login()
    resp = httpx.post(f"{login_envd.envd.url}/init", json={"defaultUser": "loginuser"})
    assert resp.status_code == 204
    assert "--noprofile" in login_envd.run("line=$(tr '\\0' ' ' < /proc/$$/cmdline); echo \"$line\"")
    replacement = login_envd.root / "replacement-profile"
    replacement.write_text(HOME_PROFILE + "export RESTORED=1\n")
    os.chown(replacement, LOGIN_UID, LOGIN_UID)
    login_envd.in_namespace("mount", "--bind", str(replacement), str(login_envd.home / ".profile"))
    try:
        # Behind envd's back: the captured login still stands ...
        assert login_envd.run("echo ${RESTORED-stale}") == "stale\n"
        # ... also after an /init that says the sandbox ran on since the last one (a claim of a
        # pooled sandbox, a thaw: nothing could change unseen, so nothing is checked) ...
        no_restore = {"defaultUser": "loginuser", ENVD_INIT_REVALIDATE: False}
        assert httpx.post(f"{login_envd.envd.url}/init", json=no_restore).status_code == 204
        assert login_envd.run("echo ${RESTORED-stale}") == "stale\n"
        bad = httpx.post(f"{login_envd.envd.url}/init", json={ENVD_INIT_REVALIDATE: "no"})
        assert bad.status_code == 400 and ENVD_INIT_REVALIDATE in bad.json()["message"]
        resp = httpx.post(f"{login_envd.envd.url}/init", json={"defaultUser": "loginuser"})
        assert resp.status_code == 204
        # ... until /init.
        assert login_envd.run("echo ${RESTORED-stale}") == "1\n"
        assert login_envd.uses_captured_login()
    finally:
        login_envd.in_namespace("umount", str(login_envd.home / ".profile"))
        httpx.post(f"{login_envd.envd.url}/init", json={"defaultUser": "loginuser"})


def test_init_keeps_captured_logins_when_other_files_of_home_change(login_envd: LoginEnvd) -> None:
    """A file written next to ``~/.profile`` (a snapshot's sandbox wrote its work there) changes
    the home directory's times, not what the login reads: the capture stands after /init, and the
    very first command after it starts without the profile (no new capture to wait for)."""
    assert login_envd.uses_captured_login()
    work = login_envd.home / "state.txt"
    work.write_text("written by the sandbox")
    os.chown(work, LOGIN_UID, LOGIN_UID)
    try:
        resp = httpx.post(f"{login_envd.envd.url}/init", json={"defaultUser": "loginuser"})
        assert resp.status_code == 204
        cmdline = login_envd.run("line=$(tr '\\0' ' ' < /proc/$$/cmdline); echo \"$line\"")
        assert "--noprofile" in cmdline, cmdline
    finally:
        work.unlink()


def test_envd_keeps_no_idle_processes(login_envd: LoginEnvd) -> None:
    """No pre-started shells: between commands envd has no children (nothing of a user's
    lingers, nothing extra is in a sandbox's checkpoint)."""
    assert login_envd.uses_captured_login()
    time.sleep(0.5)
    tasks = Path(f"/proc/{login_envd.envd.proc.pid}/task")  # unshare exec'd sh, which exec'd envd
    assert [c for t in tasks.iterdir() for c in (t / "children").read_text().split()] == []
