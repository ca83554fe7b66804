"""With ``FORKYARD_ENVD_FILES_AS_USER=1`` (ours; E2B's default, file operations as root, is
tests/system/test_e2b_conventions.py), envd's file operations act with the rights of the user a
request names; and envd cannot be stopped or read by what runs in its sandbox (issue 15, items
4, 6 and 7).

Through the official SDK against a real server and a real gVisor sandbox (the base template:
``user`` is uid 1000, ``/etc/shadow`` is root's, mode 0640 root:shadow).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException

from tests.support.server import serve

pytestmark = pytest.mark.requires_root("runs a server with real gVisor sandboxes")


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    with serve(prefix="forkyard-perm-", extra_env={"FORKYARD_ENVD_FILES_AS_USER": "1"}) as server:
        sandbox = Sandbox.create(timeout=300, metadata={"suite": "envd-permissions"}, **server.sdk_opts)
        try:
            yield sandbox
        finally:
            sandbox.kill()


def _as_root(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, user="root").stdout


def _denied(exc: pytest.ExceptionInfo[SandboxException]) -> None:
    """E2B's error shapes: HTTP 403 ``{"code","message"}`` / Connect ``permission_denied``, which
    the SDK raises as SandboxException with the status or code in front."""
    text = str(exc.value).lower()
    assert "403" in text or "permission_denied" in text or "permission denied" in text, text
    assert ".envd-new-" not in text and ".envd-over-" not in text, text  # the target, not our temp file


def test_read_needs_the_users_read_right(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException) as exc:
        sbx.files.read("/etc/shadow", user="user")
    _denied(exc)
    assert "permission denied" in str(exc.value).lower()
    assert "root:" in sbx.files.read("/etc/shadow", user="root")
    # Downloading what the user can read works as before, gzip too.
    assert "root:" in sbx.files.read("/etc/passwd", user="user")


def test_write_outside_the_users_rights_fails_and_leaves_nothing(sbx: Sandbox) -> None:
    for path in ("/home/user/../../etc/evil", "/etc/evil", "/root/evil", "/usr/local/evil/dir/f"):
        with pytest.raises(SandboxException) as exc:
            sbx.files.write(path, "x", user="user")
        _denied(exc)
    found = _as_root(sbx, "ls -a /etc | grep -c evil; ls -a /root /usr/local | grep -c evil || true")
    assert found.split() == ["0", "0"]
    # Overwriting a root-owned file the user may not write, in a directory they may not write.
    with pytest.raises(SandboxException):
        sbx.files.write("/etc/hostname", "pwned", user="user")
    assert "pwned" not in _as_root(sbx, "cat /etc/hostname")
    # Root may.
    sbx.files.write("/etc/forkyard-root-file", "ok", user="root")
    assert _as_root(sbx, "stat -c '%U:%G' /etc/forkyard-root-file").strip() == "root:root"


def test_what_the_user_creates_is_theirs(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/new/deep/file.txt", "mine", user="user")
    sbx.files.make_dir("/home/user/made", user="user")
    sbx.files.write("/tmp/user-tmp.txt", "t", user="user")
    owners = _as_root(
        sbx,
        "stat -c '%U:%G' /home/user/new /home/user/new/deep /home/user/new/deep/file.txt "
        "/home/user/made /tmp/user-tmp.txt",
    ).split()
    assert owners == ["user:user"] * 5
    info = sbx.files.get_info("/home/user/new/deep/file.txt", user="user")
    assert (info.owner, info.group) == ("user", "user")
    # Root's uploads stay root's.
    sbx.files.write("/tmp/root-tmp.txt", "r", user="root")
    assert _as_root(sbx, "stat -c '%U' /tmp/root-tmp.txt").strip() == "root"
    # Nor replace root's file where they may not write (the upload is renamed into place).
    with pytest.raises(SandboxException):
        sbx.files.write("/etc/forkyard-root-file", "u", user="user")


def test_filesystem_rpcs_act_as_the_user(sbx: Sandbox) -> None:
    _as_root(sbx, "mkdir -p /root/secret && echo s > /root/secret/f && touch /etc/forkyard-keep")
    attempts = {
        "list": lambda: sbx.files.list("/root", user="user"),
        "get_info": lambda: sbx.files.get_info("/root/secret/f", user="user"),
        "make_dir": lambda: sbx.files.make_dir("/etc/forkyard-dir", user="user"),
        "rename": lambda: sbx.files.rename("/etc/forkyard-keep", "/home/user/stolen", user="user"),
        "remove": lambda: sbx.files.remove("/etc/forkyard-keep", user="user"),
        "watch_dir": lambda: sbx.files.watch_dir("/root", user="user"),
    }
    allowed = []
    for name, attempt in attempts.items():
        try:
            attempt()
        except SandboxException as exc:
            text = str(exc).lower()
            assert "permission_denied" in text or "permission denied" in text, (name, text)
        else:
            allowed.append(name)
    assert allowed == [], _as_root(sbx, "stat -c '%A %U %n' /root /root/secret /etc")
    assert _as_root(sbx, "ls /etc/forkyard-keep; test -e /etc/forkyard-dir || echo absent").split() == [
        "/etc/forkyard-keep",
        "absent",
    ]
    # Root's RPCs see everything, as before.
    assert [e.name for e in sbx.files.list("/root/secret", user="root")] == ["f"]
    # The user's own RPCs work: move and remove inside their home.
    sbx.files.write("/home/user/mv-src", "m", user="user")
    sbx.files.rename("/home/user/mv-src", "/home/user/sub/mv-dst", user="user")
    assert sbx.files.read("/home/user/sub/mv-dst", user="user") == "m"
    sbx.files.remove("/home/user/sub", user="user")
    assert not sbx.files.exists("/home/user/sub", user="user")


def test_nul_bytes_in_paths_are_bad_input(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/tmp/a\0b")
    with pytest.raises(InvalidArgumentException):
        sbx.files.write("/tmp/a\0b", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.get_info("/tmp/a\0b")
    assert sbx.commands.run("echo still here").stdout == "still here\n"


_TRACER = r"""
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
envd = int(sys.argv[1])
print("envd", libc.ptrace(PTRACE_ATTACH, envd, None, None), ctypes.get_errno())
try:
    open(f"/proc/{envd}/mem", "rb").close()
    print("mem", "open")
except OSError as exc:
    print("mem", exc.errno)
child = subprocess.Popen(["sleep", "30"])
attached = libc.ptrace(PTRACE_ATTACH, child.pid, None, None)
if attached == 0:
    os.waitpid(child.pid, 0)
    libc.ptrace(PTRACE_DETACH, child.pid, None, None)
print("child", attached)
child.kill()
"""


def test_envd_cannot_be_attached_or_read_by_root(sbx: Sandbox) -> None:
    """Root attaching envd used to stop it for good (the attach's SIGSTOP; reproduced under
    gVisor: every later call timed out). envd is not dumpable and CAP_SYS_PTRACE is out of
    every process it starts, so the attach and /proc/<envd>/mem are refused (EPERM/EACCES)
    while root still traces its own processes."""
    envd_pid = _as_root(sbx, "ps -eo pid,args | awk '/forkyard.(bin.)?envd/ {print $1; exit}'").strip() or "1"
    sbx.files.write("/tmp/tracer.py", _TRACER, user="root")
    output = _as_root(sbx, f"python3 /tmp/tracer.py {envd_pid}")
    lines = dict(line.split(" ", 1) for line in output.splitlines())
    assert lines["envd"] == "-1 1", lines  # EPERM
    assert lines["mem"] in ("1", "13"), lines  # EPERM / EACCES
    assert lines["child"] == "0", lines
    assert sbx.commands.run("echo alive", timeout=10).stdout == "alive\n"
    assert "CapEff:\t0000000000000000" in sbx.commands.run("grep CapEff /proc/self/status").stdout
    root_caps = int(_as_root(sbx, "grep CapEff /proc/self/status").split()[1], 16)
    assert not root_caps & (1 << 19)  # CAP_SYS_PTRACE
