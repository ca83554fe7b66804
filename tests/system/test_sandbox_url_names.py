"""Sandbox URLs resolve on the host with nothing configured: ``<port>-<id>.forkyard.localhost``
(the default sandbox domain) through the host's own resolver, as E2B users' clients and E2B's SDK
suites reach them (``fetch``/``httpx`` of ``https://{sandbox.get_host(port)}``).

The host resolves every ``*.localhost`` name to loopback through glibc's ``myhostname`` NSS
module (Debian's ``libnss-myhostname``, which scripts/bootstrap.sh installs and whose postinst adds
it to /etc/nsswitch.conf); a stock Debian 12 answered "Name or service not known". No DNS
responder here and nothing patched: this process's and node's plain ``getaddrinfo``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from forkyard.api.server import sandbox_names_resolve
from tests.support import REPO, TESTS, free_port
from tests.support.server import ServerProcess, start_server

pytestmark = [pytest.mark.requires_root("sandboxes")]

DOMAIN = "forkyard.localhost"  # the default FORKYARD_SANDBOX_DOMAIN


def test_the_host_resolves_sandbox_names_to_loopback() -> None:
    infos = socket.getaddrinfo(f"8080-abcdef.{DOMAIN}", 443, type=socket.SOCK_STREAM)
    assert {info[4][0] for info in infos} <= {"127.0.0.1", "::1"} and infos
    assert sandbox_names_resolve(DOMAIN)
    assert not sandbox_names_resolve("forkyard.invalid")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    data_dir = Path(tempfile.mkdtemp(prefix="aenames-", dir="/tmp"))
    srv = start_server(data_dir, extra_env={"FORKYARD_TLS_PORT": str(free_port())})
    try:
        yield srv
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_users_clients_reach_get_host_urls_through_the_host_resolver(server: ServerProcess) -> None:
    """In a process of its own started with ``SSL_CERT_FILE`` (TLS clients read trust roots once
    per process), the SDK without ``E2B_SANDBOX_URL``, as a user's program runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_SANDBOX_URL", "E2B_DEBUG")}
    env |= {
        "SSL_CERT_FILE": str(server.data_dir / "tls" / "ca-bundle.pem"),
        "NODE_EXTRA_CA_CERTS": str(server.data_dir / "tls" / "ca.pem"),
        "E2B_API_URL": server.url,
        "E2B_API_KEY": server.api_key,
    }
    argv = [sys.executable, "-m", "tests.system.test_sandbox_url_names"]
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok: httpx and node fetch of get_host" in proc.stdout


_NODE_FETCH = "const r = await fetch(process.argv[1]); console.log(r.status, await r.text());"


def _client() -> None:
    sbx = Sandbox.create("base", timeout=120)
    try:
        sbx.files.write("/home/user/www/index.html", "named")
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8000", background=True)
        url = f"https://{sbx.get_host(8000)}/index.html"
        assert f"8000-{sbx.sandbox_id}.{DOMAIN}:" in url
        deadline = time.monotonic() + 30
        while True:
            try:
                resp = httpx.get(url, timeout=10)
                if resp.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.2)
        assert resp.text == "named"
        node = subprocess.run(
            ["node", "--input-type=module", "-e", _NODE_FETCH, url],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=TESTS / "js",
        )
        assert node.returncode == 0 and node.stdout.strip() == "200 named", node.stderr[-2000:]
    finally:
        sbx.kill()
    print("ok: httpx and node fetch of get_host", flush=True)


if __name__ == "__main__":
    if shutil.which("node") is None:
        sys.exit("node is not installed")
    _client()
