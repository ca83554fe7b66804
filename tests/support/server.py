"""A real ``forkyard serve`` subprocess: what the system tests and the benchmarks run against.

    with serve() as server:                      # throw-away data dir, random API key
        Sandbox.create(**server.sdk_opts)
    # here every sandbox of the server is killed, the server stopped, its data dir removed

:func:`start_server` is the lower level for tests that restart a server on the same data dir
(``start_server(old.data_dir, port=old.port, api_key=old.api_key)``) or ``kill -9`` it.

The server reads templates from the shared cache (``FORKYARD_TEMPLATES_PATH``, default
``/var/lib/forkyard/templates``; nothing is copied) and logs to ``<data_dir>/server-<port>.log``.
No pytest here: bench/ imports this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support import REPO, SHARED_TEMPLATES, free_port
from tests.support.leaks import mounts_under

#: The test servers' settings that differ from a production server. Warm pools keep restored
#: sandboxes running: only the tests of pools turn them on. Benchmarks pass ``defaults={}``.
TEST_DEFAULTS: Mapping[str, str] = {
    "FORKYARD_MAX_UPLOAD_BYTES": str(64 << 20),
    "FORKYARD_WARM_POOL_HIGH": "0",
    # Sandbox URLs over HTTPS bind a fixed port: only their own tests turn them on (on a free one).
    "FORKYARD_TLS_PORT": "0",
    # code-interpreter-v1 is built once into the shared cache (make test), never by a test server.
    "FORKYARD_BUILD_CODE_INTERPRETER": "false",
}
READY_TIMEOUT = 90.0


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
        """The environment variables the official SDKs read (Python and JS)."""
        return {
            "E2B_API_URL": self.url,
            "E2B_SANDBOX_URL": self.url,
            "E2B_API_KEY": self.api_key,
            "E2B_VOLUME_API_URL": self.url,  # the volume content API is the same listener
        }

    @property
    def sdk_opts(self) -> dict[str, str]:
        """Keyword arguments for the Python SDK: ``Sandbox.create(**server.sdk_opts)``."""
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.api_key}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def kill_hard(self) -> None:
        """``kill -9`` the server (its sandboxes keep running: a restart re-attaches them)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. Sandboxes outlive a stopped server."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_hard()

    def kill_all_sandboxes(self) -> list[str]:
        """Kill every sandbox the server lists; return their ids. Nothing when it is not running."""
        if self.proc.poll() is not None:
            return []
        try:
            listed = httpx.get(self.url + "/v2/sandboxes", headers=self.headers, timeout=30).json()
        except (httpx.HTTPError, ValueError):
            return []
        ids = [s["sandboxID"] for s in listed]
        for sid in ids:
            with contextlib.suppress(httpx.HTTPError):
                httpx.delete(f"{self.url}/sandboxes/{sid}", headers=self.headers, timeout=120)
        return ids


def kill_all_sandboxes(server: ServerProcess) -> list[str]:
    """Kill whatever a (failed) test left running, so the session leaves nothing behind."""
    return server.kill_all_sandboxes()


def start_server(
    data_dir: Path,
    *,
    port: int | None = None,
    api_key: str | None = None,
    runtime: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    defaults: Mapping[str, str] = TEST_DEFAULTS,
    ready_timeout: float = READY_TIMEOUT,
    python: Path | None = None,
    log_dir: Path | None = None,
) -> ServerProcess:
    """Start ``forkyard serve`` on ``data_dir`` and wait until ``/health`` answers (its log in
    ``log_dir``, default the data dir).

    ``runtime`` sets ``FORKYARD_RUNTIME`` (else it is inherited, default auto); ``extra_env`` wins
    over ``defaults``. ``python`` runs the server of another environment (an installed wheel; then
    from the data dir, so that this checkout is not on its path). Raises RuntimeError with the
    log's tail when the server exits or does not get ready in ``ready_timeout`` s (after killing
    what it started).
    """
    port = port or free_port()
    api_key = api_key or "e2b_test_" + secrets.token_hex(8)
    env = {
        **os.environ,
        "FORKYARD_DATA_DIR": str(data_dir),
        "FORKYARD_TEMPLATES_PATH": str(SHARED_TEMPLATES),
        "FORKYARD_API_KEYS": json.dumps([api_key]),
        **defaults,
        **({"FORKYARD_RUNTIME": runtime} if runtime else {}),
        **(extra_env or {}),
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = (log_dir or data_dir) / f"server-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(python or sys.executable), "-m", "forkyard.cli.main", "serve", "--port", str(port)],
            env=env,
            cwd=data_dir if python else REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", api_key, data_dir, port, proc, log_path)
    deadline = time.monotonic() + ready_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"forkyard serve exited ({proc.returncode}):\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + "/health", timeout=1).is_success:
                return server
        if time.monotonic() > deadline:
            server.kill_all_sandboxes()
            server.stop()
            raise RuntimeError(
                f"forkyard serve did not answer /health in {ready_timeout:.0f} s:\n{server.log_tail()}"
            )
        time.sleep(0.2)


def remove_data_dir(data_dir: Path) -> list[str]:
    """Remove a stopped server's data dir; return the mounts that kept it (then it stays).

    The QEMU runtime's reflink pool (an XFS image loop-mounted at ``<data_dir>/layers``) is the
    server's own and is destroyed first; any other mount below is a leak and is left alone
    (never ``rm -rf`` through a live mount).
    """
    if (data_dir / "layers.xfs").exists():
        with contextlib.suppress(ImportError, OSError, RuntimeError):
            from forkyard.storage.reflink import ReflinkPool

            ReflinkPool(data_dir).destroy()
    mounted = mounts_under(data_dir)
    if not mounted:
        shutil.rmtree(data_dir, ignore_errors=True)
    return mounted


@contextlib.contextmanager
def serve(
    *,
    prefix: str = "forkyard-",
    runtime: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    defaults: Mapping[str, str] = TEST_DEFAULTS,
    api_key: str | None = None,
    keep_data_dir: bool = False,
) -> Iterator[ServerProcess]:
    """A server on a free port with a fresh data dir (``/tmp/<prefix>*``: runsc's unix sockets
    live in it, so the path must stay short). On the way out, also after a failure: kill every
    sandbox it lists, stop it, remove the data dir (see :func:`remove_data_dir`; kept when
    ``keep_data_dir``, e.g. to read the log afterwards)."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    server = None
    try:
        server = start_server(
            data_dir, runtime=runtime, extra_env=extra_env, defaults=defaults, api_key=api_key
        )
        yield server
    finally:
        if server is not None:
            server.kill_all_sandboxes()
            server.stop()
        if not keep_data_dir:
            remove_data_dir(data_dir)
