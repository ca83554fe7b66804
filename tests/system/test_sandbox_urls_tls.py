"""The official SDK itself through the HTTPS listener, as an E2B user's code runs: no
``E2B_SANDBOX_URL``, so the SDK reaches envd at ``https://49983-{id}.{domain}`` (commands, files)
and ``sandbox.get_host(port)`` names a server in the sandbox, both over TLS trusted through
``SSL_CERT_FILE`` (the ``ca-bundle.pem`` the server prints).

Names: the SDK's own HTTP client (pyqwest, Rust) resolves ``*.localhost`` names to loopback
itself (RFC 6761), so its envd traffic needs nothing; it trusts the CA through ``SSL_CERT_FILE``.
For the user's own client (httpx here) this process must not change the machine's resolver, so
it resolves the names under the sandbox domain by asking the node's DNS responder
(``FORKYARD_DNS_LISTEN``) over UDP, in its own ``socket.getaddrinfo``: what a stock resolver
does once it forwards ``*.{domain}`` to the responder (docs/ARCHITECTURE.md). Everything else
(the SDK, httpx, TLS, the listener, envd) is the real thing. tests/system/test_sandbox_urls.py
covers the listener's and the responder's details.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from dnslib import QTYPE, DNSRecord
from e2b import AsyncSandbox, Sandbox

from tests.support import REPO, free_port
from tests.support.server import ServerProcess, start_server

pytestmark = [pytest.mark.requires_root("sandboxes")]

DOMAIN = "forkyard.localhost"


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TlsNode:
    server: ServerProcess
    dns_port: int
    #: ``{domain}:{tls port}``: what sandbox URLs end in.
    tls_host: str
    #: Names this process resolved through the node's responder.
    asked: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsNode]:
    data_dir = Path(tempfile.mkdtemp(prefix="aetls-", dir="/tmp"))
    dns_port, tls_port = _free_udp_port(), free_port()
    server = start_server(
        data_dir,
        extra_env={
            "FORKYARD_TLS_PORT": str(tls_port),
            "FORKYARD_SANDBOX_DOMAIN": DOMAIN,
            "FORKYARD_DNS_LISTEN": f"127.0.0.1:{dns_port}",
        },
    )
    try:
        yield TlsNode(server, dns_port, f"{DOMAIN}:{tls_port}")
    finally:
        server.kill_all_sandboxes()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def _resolve_sandbox_names(dns_port: int, asked: list[str]) -> None:
    """This process resolves names under the sandbox domain through the node's responder."""
    system_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name == DOMAIN or name.endswith("." + DOMAIN):
            asked.append(name)
            reply = DNSRecord.parse(DNSRecord.question(name).send("127.0.0.1", dns_port, timeout=3))
            host = next(str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A)
        return system_getaddrinfo(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]


def test_the_sdk_and_get_host_go_through_the_https_listener(tls_server: TlsNode) -> None:
    """In a process of its own that starts with ``SSL_CERT_FILE`` set, as a user's program does:
    TLS clients (the SDK's pyqwest among them) read their trust roots once per process, so a
    variable set after some other test's client was made would not reach them."""
    server = tls_server.server
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_SANDBOX_URL", "E2B_DEBUG")}
    env |= {
        "SSL_CERT_FILE": str(server.data_dir / "tls" / "ca-bundle.pem"),
        "E2B_API_URL": server.url,
        "E2B_API_KEY": server.api_key,
    }
    argv = [
        sys.executable,
        "-m",
        "tests.system.test_sandbox_urls_tls",
        str(tls_server.dns_port),
        tls_server.tls_host,
    ]
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok: sdk, get_host and async over TLS" in proc.stdout


def _client(dns_port: int, tls_host: str) -> None:
    asked: list[str] = []
    _resolve_sandbox_names(dns_port, asked)
    sbx = Sandbox.create("base", timeout=120)
    try:
        # envd's own traffic: https://49983-{id}.{domain}:{tls port}, the node's certificate.
        sbx.files.write("/home/user/www/index.html", "served in the sandbox")
        assert sbx.commands.run("cat /home/user/www/index.html").stdout == "served in the sandbox"
        assert sbx.envd_api_url == f"https://49983-{sbx.sandbox_id}.{tls_host}"
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8000", background=True)
        url = f"https://{sbx.get_host(8000)}/index.html"
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = httpx.get(url, timeout=10)  # trusts SSL_CERT_FILE, as users' clients do
                if resp.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.2)
        assert resp.text == "served in the sandbox"
        assert resp.url.scheme == "https" and resp.url.host == f"8000-{sbx.sandbox_id}.{DOMAIN}"
        assert resp.url.host in asked  # resolved by the node's responder
        # The async SDK takes the same path.
        asyncio.run(_async_commands(sbx.sandbox_id))
    finally:
        sbx.kill()
    print("ok: sdk, get_host and async over TLS", flush=True)


async def _async_commands(sandbox_id: str) -> None:
    sbx = await AsyncSandbox.connect(sandbox_id)
    result = await sbx.commands.run("echo async-over-tls")
    assert result.stdout == "async-over-tls\n"


if __name__ == "__main__":
    _client(int(sys.argv[1]), sys.argv[2])
