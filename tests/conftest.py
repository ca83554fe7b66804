"""Test suite set-up. Layout:

* tests/unit/ - no root, no runsc/QEMU/KVM, no network namespaces, no server with a real
  runtime: ``make test-unit`` (about a minute, any user).
* tests/system/ - real sandboxes, servers and host resources (root, runsc, QEMU, the base
  template): part of ``make test``; run them one at a time per host
  (``flock /tmp/forkyard-systest.lock ...``).
* tests/support/ - helpers and fixtures (see tests/support/__init__.py).

Markers (pyproject.toml): ``requires_root("why")`` skips, printing why, unless run as root;
``kvm`` skips, printing why, unless /dev/kvm can boot guests (vmx/svm, or PVM when
``FORKYARD_FIRECRACKER__PVM`` is set). Skips are listed with ``-rs``.
"""

from __future__ import annotations

import os
import uuid
from functools import cache

import pytest

from tests.support import TESTS, leaks

pytest_plugins = ["tests.support.fixtures", "tests.support.postgres"]


def _pvm_requested() -> bool:
    """Firecracker is set to PVM mode (``FORKYARD_FIRECRACKER__PVM``): then PVM guests count."""
    try:
        from forkyard.config import Settings

        return bool(Settings().firecracker.pvm)
    except Exception:  # config in the middle of a change: assume the default
        return False


@cache
def kvm_missing() -> str | None:
    """Why hardware-virtualised guests cannot run here (None when they can)."""
    try:
        from forkyard.runtime.kvm import kvm_unusable_reason
    except ImportError as exc:
        return f"cannot check KVM: {exc}"
    return kvm_unusable_reason(pvm=_pvm_requested())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    is_root = os.geteuid() == 0
    for item in items:
        marker = item.get_closest_marker("requires_root")
        if marker is not None and not is_root:
            why = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"needs root: {why}" if why else "needs root"))
        if item.get_closest_marker("kvm") is not None and kvm_missing() is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs KVM with vmx/svm: {kvm_missing()}"))


# -- the host leak check of system-test runs ---------------------------------------------------

_HOST_BEFORE = pytest.StashKey[leaks.HostState]()


#: ``processes``: this session makes no host network resources (the emulated KVM host's suite,
#: which scripts/test.sh runs beside the rest), so its check looks at its own processes only.
HOST_CHECK_ENV = "FORKYARD_TEST_HOST_CHECK"


def pytest_configure(config: pytest.Config) -> None:
    # Inherited by every process this session starts: the host check tells sessions apart by it.
    os.environ[leaks.SESSION_ENV] = uuid.uuid4().hex


def _processes_only() -> bool:
    return os.environ.get(HOST_CHECK_ENV) == "processes"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before system tests run as root: note the host's network namespaces, veths and sandbox
    processes (compared at the end of the run)."""
    if session.config.option.collectonly or os.geteuid() != 0:
        return
    if any(item.path.is_relative_to(TESTS / "system") for item in session.items):
        session.config.stash[_HOST_BEFORE] = leaks.host_state(processes_only=_processes_only())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    before = config.stash.get(_HOST_BEFORE, None)
    if before is None:
        return
    left = leaks.wait_host_clean(before, processes_only=_processes_only())
    terminalreporter.section("host leak check")
    if left:
        terminalreporter.write_line("left on the host by this run (or by a concurrent one):", red=True)
        for line in left:
            terminalreporter.write_line(f"  {line}", red=True)
    else:
        terminalreporter.write_line("no network namespace, veth or sandbox process left behind")
