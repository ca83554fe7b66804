"""End-to-end fixtures: a real ``agentenv serve`` subprocess with the real runtime.

The server gets a throw-away ``AGENTENV_DATA_DIR`` (registry, sandboxes, API key) and reads
templates from the shared cache through ``AGENTENV_TEMPLATES_PATH`` (default
``/var/lib/agentenv/templates``; nothing is copied or linked). Import the fixtures in a test
module with ``from e2e_fixtures import *``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

SHARED_TEMPLATES = Path(os.environ.get("AGENTENV_TEMPLATES_PATH", "/var/lib/agentenv/templates"))
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_template_missing() -> str | None:
    if not (SHARED_TEMPLATES / "base" / ".complete").is_file():
        return f"the base template is not built in {SHARED_TEMPLATES} (run: agentenv template build base)"
    return None


@dataclass
class ServerProcess:
    url: str
    api_key: str
    data_dir: Path
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def kill_hard(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill_hard()


def start_server(data_dir: Path, *, port: int | None = None, api_key: str = "e2b_test_" + os.urandom(8).hex(),
                 extra_env: dict[str, str] | None = None) -> ServerProcess:
    port = port or free_port()
    env = {
        **os.environ,
        "AGENTENV_DATA_DIR": str(data_dir),
        "AGENTENV_TEMPLATES_PATH": str(SHARED_TEMPLATES),
        "AGENTENV_API_KEYS": json.dumps([api_key]),
        "AGENTENV_MAX_UPLOAD_BYTES": str(64 << 20),
        # Warm pools keep restored sandboxes running: only the tests of pools turn them on.
        "AGENTENV_WARM_POOL_HIGH": "0",
        **(extra_env or {}),
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentenv.cli.main", "serve", "--port", str(port)],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", api_key, data_dir, port, proc, log_path)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"agentenv serve exited ({proc.returncode}):\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 204:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            kill_all_sandboxes(server)
            server.stop()
            raise RuntimeError(f"agentenv serve did not answer /health in 90 s:\n{server.log_tail()}")
        time.sleep(0.2)


def host_resources(sandbox_id: str) -> list[str]:
    """Host resources still named after ``sandbox_id`` (runsc processes, network namespaces)."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if sandbox_id in line]
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found += [f"process {line.strip()[:120]}" for line in ps.splitlines()
              if sandbox_id in line and "runsc" in line]
    return found


def wait_no_host_resources(sandbox_id: str, timeout: float = 15) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = host_resources(sandbox_id)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def kill_all_sandboxes(server: ServerProcess) -> list[str]:
    """Kill whatever a (failed) test left running, so the session leaves nothing behind."""
    if server.proc.poll() is not None:
        return []
    headers = {"X-API-Key": server.api_key}
    listed = httpx.get(server.url + "/v2/sandboxes", headers=headers, timeout=30).json()
    ids = [s["sandboxID"] for s in listed]
    for sid in ids:
        httpx.delete(f"{server.url}/sandboxes/{sid}", headers=headers, timeout=120)
    return ids


@pytest.fixture(scope="session")
def agentenv_server() -> Iterator[ServerProcess]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="agentenv-e2e-") as tmp:
        server = start_server(Path(tmp) / "data")
        old = {k: os.environ.get(k) for k in server.sdk_env}
        os.environ.update(server.sdk_env)
        try:
            yield server
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            kill_all_sandboxes(server)
            server.stop()
