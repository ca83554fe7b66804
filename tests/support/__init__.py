"""Test support shared by tests/unit, tests/system and bench/ (import it as ``tests.support``).

* this module - where things are (:data:`REPO`, :data:`TESTS`, :data:`SHARED_TEMPLATES`), free
  loopback ports, collision-free sandbox ids, "is the base template built?".
* :mod:`tests.support.server` - a real ``forkyard serve`` subprocess with a throw-away data dir
  (the system tests and the benchmarks start their servers with it).
* :mod:`tests.support.leaks` - probes for what a sandbox leaves on the host (network namespaces,
  veths, mounts, runsc/QEMU/Firecracker processes).
* :mod:`tests.support.loops` - what a test leaves in the event loop later tests share (fds
  closed under the loop's selector; tests/unit/conftest.py fails the test that does it).
* :mod:`tests.support.counter` - a counting process in a sandbox: proof that memory survives a
  pause, snapshot, fork or server restart.
* :mod:`tests.support.loopback` - a loopback "runtime" whose sandboxes are plain HTTP servers
  (the API-layer unit tests).
* :mod:`tests.support.kvmhost` - an emulated KVM host (QEMU TCG with AMD SVM) running the node
  with real Firecracker microVMs (``make kvm-host``; :mod:`tests.support.kvmhost_agent` runs in it).
* :mod:`tests.support.fixtures` - the shared pytest fixtures (loaded by tests/conftest.py through
  ``pytest_plugins``; never import fixtures by hand).

Nothing here imports pytest or forkyard at import time, except :mod:`tests.support.fixtures`
(pytest) and :mod:`tests.support.loopback` (forkyard's Runtime base class).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
#: The template cache the tests and benchmarks read (building ``base`` once takes about a minute).
SHARED_TEMPLATES = Path(os.environ.get("FORKYARD_TEMPLATES_PATH", "/var/lib/forkyard/templates"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unique_id(prefix: str = "t") -> str:
    """A sandbox id that cannot collide with other tests or helpers on the same host."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def base_template_missing() -> str | None:
    """Why the shared ``base`` template cannot be used, or None when it is built."""
    if not (SHARED_TEMPLATES / "base" / ".complete").is_file():
        return f"the base template is not built in {SHARED_TEMPLATES} (run: forkyard template build base)"
    return None
