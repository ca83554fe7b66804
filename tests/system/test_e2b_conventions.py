"""E2B's conventions inside the sandbox (issue 24, the in-sandbox items), through the official SDKs
against a real server and real gVisor sandboxes of the ``base`` template:

- ``sudo`` for the default user ``user``: passwordless, ``-u``, ``-E``, exit codes, a terminal;
  brokered by envd under gVisor, which ignores set-uid bits (forkyard/envd/process/sudo.py);
- the files API as E2B's envd does it: as root, what it creates given to the user;
- ``files.read`` of a /proc file (size 0, content to EOF);
- a relative path in the JS SDK's ``files.write([...])`` lands in the user's home;
- a sandbox killed during a command: the SDKs raise their sandbox-gone errors;
- a template's final WORKDIR is where commands start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException, SandboxNotRunningException
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize

from tests.support import SHARED_TEMPLATES, TESTS, base_template_missing
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("runs a server with real gVisor sandboxes")

JS_DIR = TESTS / "js"


@pytest.fixture(scope="module")
def sbx(forkyard_server: ServerProcess) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300, metadata={"suite": "e2b-conventions"})
    try:
        yield sandbox
    finally:
        sandbox.kill()


# -- sudo -------------------------------------------------------------------------------------


def test_sudo_is_passwordless_root_for_the_default_user(sbx: Sandbox) -> None:
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("sudo whoami").stdout == "root\n"
    assert sbx.commands.run("sudo -n true && echo ok").stdout == "ok\n"
    # What agent code does with it: root-only files and package management.
    sbx.commands.run("sudo sh -c 'echo made-by-sudo > /etc/forkyard-sudo-test'")
    assert sbx.files.read("/etc/forkyard-sudo-test") == "made-by-sudo\n"
    out = sbx.commands.run("sudo apt-get check 2>&1; echo rc=$?").stdout
    assert out.rstrip().endswith("rc=0"), out
    # The full path works too (scripts call /usr/bin/sudo), and it keeps the working directory.
    assert sbx.commands.run("cd /usr/share && /usr/bin/sudo pwd").stdout == "/usr/share\n"


def test_sudo_user_environment_and_exit_codes(sbx: Sandbox) -> None:
    assert sbx.commands.run("sudo -u nobody id -un").stdout == "nobody\n"
    assert sbx.commands.run("sudo -iu root pwd").stdout == "/root\n"
    env = sbx.commands.run("sudo env").stdout.splitlines()
    assert {"HOME=/root", "USER=root", "SUDO_USER=user", "SUDO_UID=1000"} <= set(env), env
    # env_reset without -E; -E keeps the caller's variables; VAR=value sets one.
    assert sbx.commands.run("FOO=bar sudo sh -c 'echo ${FOO:-unset}'").stdout == "unset\n"
    assert sbx.commands.run("FOO=bar sudo -E sh -c 'echo $FOO'").stdout == "bar\n"
    assert sbx.commands.run("sudo BAZ=qux sh -c 'echo $BAZ'").stdout == "qux\n"
    # Exit codes pass through; stdin, stdout and stderr are the caller's.
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("sudo sh -c 'echo out; echo err >&2; exit 7'")
    assert (exc.value.exit_code, exc.value.stdout, exc.value.stderr) == (7, "out\n", "err\n")
    assert sbx.commands.run("echo piped | sudo cat").stdout == "piped\n"
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("sudo no-such-program-here")
    assert exc.value.exit_code == 1 and "command not found" in exc.value.stderr
    # Users sudoers does not name are refused, as sudo refuses them.
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("sudo -u nobody sudo true")
    assert exc.value.exit_code == 1 and "nobody is not in the sudoers file" in exc.value.stderr


def test_sudo_in_a_terminal_and_signals(sbx: Sandbox) -> None:
    output = bytearray()
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=30)

    def read() -> None:
        with contextlib.suppress(CommandExitException):  # the PTY is killed at the end
            handle.wait(on_pty=output.extend)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sbx.pty.send_stdin(handle.pid, b"sudo tty; sudo -u nobody id -un; echo done-$?\n")
    deadline = time.monotonic() + 20
    while b"done-0" not in output and time.monotonic() < deadline:
        time.sleep(0.1)
    text = output.decode(errors="replace")
    assert "/dev/pts/" in text and "nobody" in text and "done-0" in text, text
    sbx.pty.kill(handle.pid)
    # Killing the sudo (as commands.kill does) ends the command it started.
    bg = sbx.commands.run("sudo sleep 300", background=True)
    deadline = time.monotonic() + 10
    while "sleep 300" not in sbx.commands.run("ps -eo args", user="root").stdout:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    sbx.commands.kill(bg.pid)
    deadline = time.monotonic() + 10
    while "sleep 300" in sbx.commands.run("ps -eo args", user="root").stdout:
        assert time.monotonic() < deadline, "the command sudo started outlived it"
        time.sleep(0.2)


# -- files --------------------------------------------------------------------------------------


def test_files_api_acts_as_root_and_gives_what_it_creates_to_the_user(sbx: Sandbox) -> None:
    sbx.files.write("/root/x", "in root's home")
    assert sbx.files.read("/root/x") == "in root's home"
    assert sbx.files.make_dir("/workspace") is True
    sbx.files.write("/opt/app/x", "deep")
    owners = sbx.commands.run("stat -c '%U:%G %n' /root/x /workspace /opt/app /opt/app/x", user="root")
    assert owners.stdout.split("\n")[:4] == [
        "user:user /root/x",
        "user:user /workspace",
        "user:user /opt/app",
        "user:user /opt/app/x",
    ]
    assert sbx.files.get_info("/workspace").owner == "user"
    # Readable as E2B's envd reads (root): root's files too.
    assert "root:" in sbx.files.read("/etc/shadow")


def test_a_refused_write_names_the_target_not_a_temp_file(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException) as exc:
        sbx.files.write("/proc/forkyard-x", "x")
    message = str(exc.value)
    assert "envd-new" not in message and "envd-over" not in message, message
    assert "/proc/forkyard-x" in message, message


def test_read_of_a_proc_file_returns_its_content(sbx: Sandbox) -> None:
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id")
    assert (
        len(boot_id.strip()) == 36
        and boot_id == sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    )
    status = sbx.files.read("/proc/self/status")
    assert "Pid:" in status
    assert sbx.files.read("/proc/sys/kernel/random/boot_id", format="bytes") == boot_id.encode()


def _node(script: str, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_js_relative_write_lands_in_the_users_home(forkyard_server: ServerProcess, sbx: Sandbox) -> None:
    script = f"""
import {{ Sandbox }} from 'e2b'
const s = await Sandbox.connect('{sbx.sandbox_id}')
const many = await s.files.write([
  {{ path: 'rel-js.txt', data: 'one' }},
  {{ path: 'sub/rel2.txt', data: 'two' }},
])
const single = await s.files.write([{{ path: 'rel-js3.txt', data: 'three' }}])
console.log(JSON.stringify({{ paths: [...many, ...single].map((f) => f.path) }}))
"""
    out = _node(script, forkyard_server.sdk_env)
    assert out["paths"] == ["/home/user/rel-js.txt", "/home/user/sub/rel2.txt", "/home/user/rel-js3.txt"]
    assert sbx.files.read("/home/user/sub/rel2.txt") == "two"


# -- a sandbox killed during a command -----------------------------------------------------------


def test_killed_sandbox_ends_a_running_command_with_the_sdk_error(forkyard_server: ServerProcess) -> None:
    victim = Sandbox.create(timeout=120)
    handle = victim.commands.run("sleep 60", background=True)
    threading.Timer(1.0, victim.kill).start()
    with pytest.raises(SandboxNotRunningException):
        handle.wait()


def test_killed_sandbox_ends_a_js_command_with_its_timeout_error(forkyard_server: ServerProcess) -> None:
    script = """
import { Sandbox, TimeoutError } from 'e2b'
const s = await Sandbox.create({ timeoutMs: 120000 })
setTimeout(() => s.kill(), 1000)
let error
try { await s.commands.run('sleep 60') } catch (e) { error = e }
const timeout = error instanceof TimeoutError
console.log(JSON.stringify({ name: error?.name, timeout, message: String(error?.message) }))
"""
    out = _node(script, forkyard_server.sdk_env)
    # The stream is cut as E2B's proxy cuts it: the SDK probes the sandbox's health and words it
    # (E2B's JS suite, sandboxKilledDuringRun.test.ts, asserts these words).
    assert out["timeout"] is True, out
    assert "sandbox was killed or reached its end of life" in str(out["message"]), out


# -- a template's WORKDIR ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build_server() -> Iterator[ServerProcess]:
    """A server whose builds go to templates of its own (``base`` linked from the shared cache)."""
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    templates = Path(tempfile.mkdtemp(prefix="forkyard-tpl-", dir="/tmp"))
    (templates / "base").symlink_to(SHARED_TEMPLATES / "base")
    try:
        with serve(prefix="forkyard-wd-", extra_env={"FORKYARD_TEMPLATES_PATH": str(templates)}) as server:
            yield server
    finally:
        shutil.rmtree(templates, ignore_errors=True)


def test_template_workdir_is_the_default_directory(build_server: ServerProcess) -> None:
    template = Template().from_template("base").set_workdir("/srv/app").run_cmd("touch marker")
    info = Template.build(template, f"workdir-{os.getpid()}", **build_server.sdk_opts)
    sandbox = Sandbox.create(info.template_id, timeout=120, **build_server.sdk_opts)
    try:
        assert sandbox.commands.run("pwd").stdout == "/srv/app\n"
        assert sandbox.commands.run("ls marker").exit_code == 0
        # Explicit cwd still wins; files API paths stay relative to the user's home.
        assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        # Restored from the build's template snapshot: its sudo mount came back with it.
        logs = httpx.get(
            f"{build_server.url}/v2/sandboxes/{sandbox.sandbox_id}/logs",
            headers=build_server.headers,
            timeout=30,
        ).json()["logs"]
        assert any("template's snapshot" in entry["message"] for entry in logs), logs
        assert sandbox.commands.run("sudo whoami").stdout == "root\n"
    finally:
        sandbox.kill()
