"""Finding a gVisor sandbox's runsc sandbox process by the pid file runsc wrote when it started it
(no `runsc state` process per start), and not mistaking another process for it."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkyard.runtime.gvisor.paths import SandboxPaths
from forkyard.runtime.gvisor.runtime import _started_sentry


@pytest.fixture
def paths(tmp_path: Path) -> SandboxPaths:
    p = SandboxPaths.of(tmp_path, "sbxwatch01")
    p.root.mkdir(parents=True)
    return p


@contextlib.contextmanager
def _process(argv0: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose command line is ``argv0 -c <sleep> *args`` (dash): bash's ``exec -a`` sets
    argv[0] as runsc's re-exec of itself does ("runsc-sandbox")."""
    proc = subprocess.Popen(["bash", "-c", f'exec -a {argv0} sh -c "sleep 60; :" "$@"', "bash", *args])
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(argv0.encode()):
            assert time.monotonic() < deadline, "the process did not exec"
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_pid_file_names_the_live_sandbox_process(paths: SandboxPaths) -> None:
    with _process("runsc-sandbox", "--root", "/x", "boot", paths.container_id) as proc:
        paths.sentry_pid_file.write_text(f"{proc.pid}\n")
        assert _started_sentry(paths) == proc.pid
    assert _started_sentry(paths) is None  # gone: the watch reports the death, not a stale pid


def test_a_reused_pid_or_another_sandbox_is_not_taken_for_it(paths: SandboxPaths) -> None:
    with _process("runsc-sandbox", "--root", "/x", "boot", "ae-someoneelse") as other:
        paths.sentry_pid_file.write_text(str(other.pid))
        assert _started_sentry(paths) is None
    with _process("sh", paths.container_id) as unrelated:
        paths.sentry_pid_file.write_text(str(unrelated.pid))
        assert _started_sentry(paths) is None


def test_no_pid_file_or_garbage_in_it_is_no_pid(paths: SandboxPaths) -> None:
    assert _started_sentry(paths) is None
    paths.sentry_pid_file.write_text("not a pid")
    assert _started_sentry(paths) is None
