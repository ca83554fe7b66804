"""Sandbox URLs: ``sandbox.get_host(port)`` reached over HTTPS with the node's CA, names served
by the node's DNS responder, signed file URLs that carry the sandbox's routing.

The server runs with its HTTPS listener and DNS responder on free ports. This test process
cannot (and must not) change the machine's resolver, so it asks the responder itself over UDP,
then connects to the address it answered with, sending the name as TLS SNI and Host: exactly
what a client does once its resolver forwards ``*.{sandbox_domain}`` to the responder.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dnslib import QTYPE, RR, A, DNSRecord
from e2b import Sandbox

from tests.support import free_port
from tests.support.server import ServerProcess, start_server

pytestmark = [pytest.mark.requires_root("sandboxes")]

DOMAIN = "forkyard.localhost"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeUpstream:
    """An upstream resolver of our own: answers every A query with 192.0.2.77."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.asked: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(4096)
            except OSError:
                return
            query = DNSRecord.parse(data)
            self.asked.append(str(query.q.qname))
            reply = query.reply()
            reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A("192.0.2.77"), ttl=5))
            self.sock.sendto(reply.pack(), addr)


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    up = FakeUpstream()
    yield up
    up.sock.close()


@pytest.fixture(scope="module")
def url_server(upstream: FakeUpstream) -> Iterator[tuple[ServerProcess, int, int]]:
    data_dir = Path(tempfile.mkdtemp(prefix="aeurl-", dir="/tmp"))
    tls_port, dns_port = free_port(), free_udp_port()
    server = start_server(
        data_dir,
        extra_env={
            "FORKYARD_TLS_PORT": str(tls_port),
            "FORKYARD_SANDBOX_DOMAIN": DOMAIN,
            "FORKYARD_DNS_LISTEN": f"127.0.0.1:{dns_port}",
            "FORKYARD_DNS_UPSTREAM": f"127.0.0.1:{upstream.port}",
        },
    )
    try:
        yield server, tls_port, dns_port
    finally:
        server.kill_all_sandboxes()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def resolve(name: str, dns_port: int) -> str:
    answer = DNSRecord.parse(DNSRecord.question(name).send("127.0.0.1", dns_port, timeout=3))
    (record,) = [rr for rr in answer.rr if rr.rtype == QTYPE.A]
    return str(record.rdata)


def fetch(url: str, dns_port: int, ca: Path) -> httpx.Response:
    """GET ``url`` the way a client whose resolver uses the responder does (SNI and Host: the name)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    address = resolve(parts.hostname, dns_port)
    target = parts._replace(netloc=f"{address}:{parts.port}").geturl()
    return get_as(target, parts.netloc, ssl.create_default_context(cafile=str(ca)))


def get_as(url: str, host: str, verify: ssl.SSLContext | bool = True) -> httpx.Response:
    """GET ``url`` with ``host`` (``name:port``) as Host and its name as TLS SNI."""
    with httpx.Client(verify=verify, timeout=15) as client:
        request = client.build_request(
            "GET", url, headers={"Host": host}, extensions={"sni_hostname": host.rsplit(":", 1)[0]}
        )
        return client.send(request)


def test_get_host_is_served_over_tls_with_the_nodes_ca(
    url_server: tuple[ServerProcess, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, tls_port, dns_port = url_server
    log = server.log_tail(20_000)
    ca = server.data_dir / "tls" / "ca.pem"
    bundle = server.data_dir / "tls" / "ca-bundle.pem"
    # make run / forkyard serve print what to export.
    assert f"export SSL_CERT_FILE={bundle}" in log and f"export NODE_EXTRA_CA_CERTS={ca}" in log
    sbx = Sandbox.create("base", timeout=120, **server.sdk_opts)
    try:
        host = sbx.get_host(8080)
        assert host == f"8080-{sbx.sandbox_id}.{DOMAIN}:{tls_port}"
        sbx.files.write("/home/user/www/hello.txt", "hello over tls")
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)
        deadline = time.monotonic() + 15
        while True:
            resp = fetch(f"https://{host}/hello.txt", dns_port, bundle)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert resp.status_code == 200 and resp.text == "hello over tls"
        # Without the node's CA the certificate is not trusted: this is real TLS.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            get_as(f"https://127.0.0.1:{tls_port}/hello.txt", host)
        # A name that is no sandbox, or a port nothing listens on, gets E2B's proxy's answer,
        # word for word (E2B's JS suite, host.test.ts, compares the whole body).
        gone = fetch(f"https://8080-inothere00000000000.{DOMAIN}:{tls_port}/", dns_port, bundle)
        assert gone.status_code == 502
        assert gone.json() == {
            "code": 502,
            "message": "The sandbox was not found",
            "sandboxId": "inothere00000000000",
        }
        closed = fetch(f"https://8081-{sbx.sandbox_id}.{DOMAIN}:{tls_port}/", dns_port, bundle)
        assert closed.status_code == 502
        assert closed.json() == {
            "code": 502,
            "message": "The sandbox is running but port is not open",
            "sandboxId": sbx.sandbox_id,
            "port": 8081,
        }

        # Signed file URLs made by an SDK that routes by name (no E2B_SANDBOX_URL) carry the
        # sandbox in their host, and work through the HTTPS listener.
        monkeypatch.delenv("E2B_SANDBOX_URL", raising=False)  # another module's server may set it
        by_name = Sandbox.connect(sbx.sandbox_id, api_key=server.api_key, api_url=server.url)
        url = by_name.download_url("/home/user/www/hello.txt", use_signature_expiration=120)
        assert urllib.parse.urlsplit(url).netloc == f"49983-{sbx.sandbox_id}.{DOMAIN}:{tls_port}"
        signed = fetch(url, dns_port, bundle)
        assert signed.status_code == 200 and signed.text == "hello over tls"
    finally:
        sbx.kill()


def test_the_dns_responder_answers_its_names_and_forwards_the_rest(
    url_server: tuple[ServerProcess, int, int], upstream: FakeUpstream
) -> None:
    _, _, dns_port = url_server
    assert resolve(f"3000-iabc.{DOMAIN}", dns_port) == "127.0.0.1"
    assert resolve(DOMAIN.upper(), dns_port) == "127.0.0.1"  # names are case-insensitive
    aaaa = DNSRecord.parse(
        DNSRecord.question(f"3000-iabc.{DOMAIN}", "AAAA").send("127.0.0.1", dns_port, timeout=3)
    )
    assert aaaa.header.rcode == 0 and aaaa.rr == []  # no IPv6: clients fall back at once
    assert resolve("www.example.test", dns_port) == "192.0.2.77"  # forwarded
    assert "www.example.test." in upstream.asked
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # garbage is ignored...
        s.sendto(b"\x00garbage", ("127.0.0.1", dns_port))
    assert resolve(f"x.{DOMAIN}", dns_port) == "127.0.0.1"  # ...and the responder lives on
