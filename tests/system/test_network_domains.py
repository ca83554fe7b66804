"""Domain names and ``*.`` wildcards in ``allow_out``, through the official SDK, against a test
host of our own.

The test host is a network namespace holding 203.0.113.10 (TEST-NET-3: not private, so only the
policy decides) with HTTPS (a self-signed certificate) on 443, HTTP on 80 and HTTP on 8443, routed
from the host over a veth, so no packet leaves the machine. The egress proxy resolves allowed
names with a DNS server of the test's own (``FORKYARD_EGRESS_RESOLVER``, dnslib's server) that
answers every ``*.example`` and ``*.example.org`` name with that address. Inside the sandbox,
``curl --resolve`` points names at addresses the way a sandbox's own resolver would.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from dnslib import QTYPE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer
from e2b import Sandbox
from e2b.sandbox.network import ALL_TRAFFIC

from tests.support import TESTS, free_port, leaks
from tests.support.server import ServerProcess, start_server

pytestmark = [pytest.mark.requires_root("sandboxes and a test host in a network namespace")]

TEST_IP = "203.0.113.10"
#: Nothing listens here: a sandbox that aims an allowed name at it still reaches the name.
ELSEWHERE = "203.0.113.99"

SERVERS = """
import http.server, ssl, sys, threading
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello {self.headers['Host']} at {self.connection.getsockname()[0]}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
def serve(port, tls):
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", port), Hello)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[1], sys.argv[2])
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()
for port, tls in ((80, False), (443, True), (8443, False)):
    threading.Thread(target=serve, args=(port, tls), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


class Names(BaseResolver):  # type: ignore[misc]
    """Every name below ``example`` or ``example.org`` (and those two) is the test host."""

    def resolve(self, request, handler):  # type: ignore[no-untyped-def]
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        if request.q.qtype == QTYPE.A and (name.endswith(".example") or name.endswith("example.org")):
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(TEST_IP), ttl=5))
        return reply


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test host")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@dataclass
class Node:
    server: ServerProcess
    env: dict[str, str]

    def restart(self) -> None:
        """kill -9 the server and start it again on the same data directory and port."""
        self.server.kill_hard()
        self.server = start_server(
            self.server.data_dir, port=self.server.port, api_key=self.server.api_key, extra_env=self.env
        )

    def sandbox(self, network: dict[str, list[str]]) -> Sandbox:
        return Sandbox.create("base", timeout=120, network=network, **self.server.sdk_opts)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    tag = uuid.uuid4().hex[:6]
    n = int(tag[:2], 16)
    netns, host_if, peer_if = f"aetd-{tag}", f"aetd{tag}", f"aete{tag}"
    host_ip, peer_ip = f"172.30.{n}.1", f"172.30.{n}.2"
    work = Path(tempfile.mkdtemp(prefix="aend-", dir="/tmp"))
    quiet = DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data")
    dns = DNSServer(Names(), port=free_port(), address="127.0.0.1", logger=quiet)
    hosts, found = None, None
    sh("ip", "netns", "add", netns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", netns)
        sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", netns, "addr", "add", f"{peer_ip}/30", "dev", peer_if)
        sh("ip", "-n", netns, "link", "set", peer_if, "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        sh("ip", "-n", netns, "addr", "add", f"{TEST_IP}/32", "dev", "lo")
        sh("ip", "-n", netns, "route", "add", "default", "via", host_ip)
        sh("ip", "route", "add", f"{TEST_IP}/32", "via", peer_ip)
        cert, key = self_signed(work)
        hosts = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", SERVERS, str(cert), str(key)],
            stdout=subprocess.PIPE,
        )
        assert hosts.stdout is not None and hosts.stdout.readline().strip() == b"ready"
        dns.start_thread()
        resolver = f"127.0.0.1:{dns.server.server_address[1]}"
        # Pauses go to disk: the network is torn down and rebuilt from the record on resume.
        env = {"FORKYARD_EGRESS_RESOLVER": resolver, "FORKYARD_PAUSE_FREEZE": "false"}
        found = Node(start_server(work / "data", extra_env=env), env)
        yield found
    finally:
        if found:
            found.server.kill_all_sandboxes()
            found.server.stop()
        dns.stop()
        if hosts:
            hosts.kill()
            hosts.wait()
        subprocess.run(["ip", "route", "del", f"{TEST_IP}/32"], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


#: Run in the sandbox: one curl per ``name port address scheme`` line, all at once; prints
#: ``name:port=<body or FAIL exit code>`` lines.
PROBE = r"""
while read -r name port addr scheme; do
  ( out=$(curl -sk --max-time 4 --resolve "$name:$port:$addr" "$scheme://$name:$port/") \
      && echo "$name:$port=$out" || echo "$name:$port=FAIL $?" ) &
done <<'EOF'
{lines}
EOF
wait
"""


def probe(sbx: Sandbox, *targets: tuple[str, int] | tuple[str, int, str]) -> dict[str, str]:
    """``name:port`` -> what the sandbox got (``FAIL <curl exit>`` when refused)."""
    lines = []
    for target in targets:
        name, port = target[0], target[1]
        addr = target[2] if len(target) > 2 else TEST_IP  # type: ignore[misc]
        lines.append(f"{name} {port} {addr} {'https' if port == 443 else 'http'}")
    out = sbx.commands.run(PROBE.format(lines="\n".join(lines)), timeout=60).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def reached(name: str) -> str:
    return f"hello {name} at {TEST_IP}"


def test_domains_and_wildcards_are_matched_on_sni_and_host(node: Node) -> None:
    sbx = node.sandbox({"allow_out": ["allowed.example", "*.example.org"], "deny_out": [ALL_TRAFFIC]})
    try:
        got = probe(
            sbx,
            ("allowed.example", 443),
            ("allowed.example", 80),
            ("denied.example", 443),
            ("denied.example", 80),
            ("a.b.example.org", 443),
            ("example.org", 443),  # the wildcard is for names below it only
            ("allowed.example", 8443),  # not 80/443: IP rules only, and those deny
        )
        assert got == {
            "allowed.example:443": reached("allowed.example"),
            "allowed.example:80": reached("allowed.example"),
            "denied.example:443": "FAIL 35",  # accepted, then closed before the TLS handshake
            "denied.example:80": "FAIL 52",  # accepted, then closed without a reply
            "a.b.example.org:443": reached("a.b.example.org"),
            "example.org:443": "FAIL 35",
            "allowed.example:8443": "FAIL 28",  # dropped: times out
        }
        # Aimed at another address (the sandbox's own resolver or /etc/hosts), an allowed name
        # still reaches only what the name is: the proxy connects to it as the host resolves it.
        assert probe(sbx, ("allowed.example", 443, ELSEWHERE)) == {
            "allowed.example:443": reached("allowed.example")
        }
        assert (sbx.get_info().network or {}).get("allow_out") == ["allowed.example", "*.example.org"]

        # An update applies to the next connection.
        sbx.update_network({"allow_out": ["denied.example"], "deny_out": [ALL_TRAFFIC]})
        assert probe(sbx, ("allowed.example", 443), ("denied.example", 80)) == {
            "allowed.example:443": "FAIL 35",
            "denied.example:80": reached("denied.example"),
        }
        sbx.update_network({"allow_out": [TEST_IP]})  # IPs only again: no proxy in the way
        assert probe(sbx, ("whatever.test", 443), ("whatever.test", 8443)) == {
            "whatever.test:443": reached("whatever.test"),
            "whatever.test:8443": reached("whatever.test:8443"),
        }
    finally:
        sbx.kill()
    assert leaks.wait_no_host_resources(sbx.sandbox_id) == []
    assert leaks.firewall_resources(sbx.sandbox_id) == []
    assert list((node.server.data_dir / "net").glob("domains-*.json")) == []


HOLD = (
    "import socket, ssl, time; c = ssl._create_unverified_context(); "
    f's = c.wrap_socket(socket.create_connection(("{TEST_IP}", 443)), server_hostname="keep.example"); '
    "time.sleep(600)"
)


def test_domain_rules_survive_pause_resume_and_fork_and_leave_nothing_behind(node: Node) -> None:
    sbx = node.sandbox({"allow_out": ["*.example"], "deny_out": [ALL_TRAFFIC]})
    try:
        # A TLS session left open through the proxy: the kill must end it on the host too.
        sbx.commands.run(f"python3 -c '{HOLD}'", background=True)
        assert probe(sbx, ("x.example", 443)) == {"x.example:443": reached("x.example")}
        data_dir = node.server.data_dir
        ip = leaks.sandbox_address(data_dir, sbx.sandbox_id)
        assert ip is not None
        deadline = time.monotonic() + 15  # the background connect may still be under way
        while not leaks.proxy_connections(data_dir, ip) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leaks.proxy_connections(data_dir, ip), "the open connection is not proxied"
        sbx.pause()
        # Paused to disk, its network is gone, and with it what the proxy relayed for it.
        assert leaks.wait_no_proxy_connections(data_dir, ip) == []
        sbx = sbx.connect()  # resumes it
        assert probe(sbx, ("y.example", 443), ("y.example.org", 443)) == {
            "y.example:443": reached("y.example"),
            "y.example.org:443": "FAIL 35",
        }
        ip = leaks.sandbox_address(node.server.data_dir, sbx.sandbox_id)
        # A fork's child inherits the policy on a network (and slot) of its own.
        response = httpx.post(
            f"{node.server.url}/sandboxes/{sbx.sandbox_id}/fork",
            json={"count": 1, "timeout": 120},
            headers={"X-API-Key": node.server.api_key},
            timeout=120,
        )
        assert response.status_code == 201, response.text
        child_id = response.json()[0]["sandbox"]["sandboxID"]
        child = Sandbox.connect(child_id, **node.server.sdk_opts)  # type: ignore[call-overload]
        assert probe(child, ("z.example", 443), ("z.example.org", 80)) == {
            "z.example:443": reached("z.example"),
            "z.example.org:80": "FAIL 52",
        }
        child.kill()
        assert leaks.wait_no_host_resources(child_id) == [] and leaks.firewall_resources(child_id) == []
    finally:
        sbx.kill()
    assert leaks.wait_no_host_resources(sbx.sandbox_id) == []
    assert leaks.firewall_resources(sbx.sandbox_id) == []
    assert ip is not None and leaks.wait_no_proxy_connections(data_dir, ip) == []
    assert list((data_dir / "net").glob("domains-*.json")) == []


def test_domain_rules_survive_a_server_restart(node: Node) -> None:
    sbx = node.sandbox({"allow_out": ["kept.example"], "deny_out": [ALL_TRAFFIC]})
    try:
        node.restart()
        again = Sandbox.connect(sbx.sandbox_id, **node.server.sdk_opts)  # type: ignore[call-overload]
        assert probe(again, ("kept.example", 443), ("other.example", 443)) == {
            "kept.example:443": reached("kept.example"),
            "other.example:443": "FAIL 35",
        }
    finally:
        sbx.kill()


def test_js_sdk_domain_rules(node: Node) -> None:
    js = TESTS / "js"
    if shutil.which("node") is None:
        pytest.fail("node is not installed (scripts/bootstrap.sh --test installs it)")
    if not (js / "node_modules" / "e2b").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=js, check=True)
    env = {**os.environ, **node.server.sdk_env, "TEST_IP": TEST_IP}
    proc = subprocess.run(
        ["node", "network_domains.mjs"], cwd=js, capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["created"] == {
        "js.example:443": reached("js.example"),
        "x.example.org:80": reached("x.example.org"),
        "no.example:443": "FAIL 35",
    }
    assert out["info"] == ["js.example", "*.example.org"]
    assert out["updated"] == {"js.example:443": "FAIL 35", "no.example:443": reached("no.example")}
