"""Sandbox network policy through the official SDKs: ``network={"allow_out", "deny_out", ...}`` on
create, ``update_network`` on a live sandbox, the default denials of private ranges, and the
ingress side (``allow_public_traffic``, ``mask_request_host``).

The destinations are test hosts of our own: one network namespace holding a TCP server on every
address below, routed from the host over two veth links, so no packet leaves the machine:

* ``public``/``public2``: 198.18.0.0/15 (RFC 2544 benchmarking, not private: reachable by default);
* ``rfc1918``/``rfc1918b``/``cgnat``/``linklocal``: 10/8, 192.168/16, 100.64/10, 169.254/16;
* ``nodenet``: the netns end of a 198.19.x.0/30 link whose other end is a host interface, i.e. a
  network the node itself sits in (a LAN neighbour): denied by default although not private.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException, SandboxException
from e2b.sandbox.network import ALL_TRAFFIC

from tests.support import TESTS
from tests.support.probes import SERVER, ProbeHosts
from tests.support.server import ServerProcess, start_server

pytestmark = [pytest.mark.requires_root("sandboxes and test hosts in network namespaces")]


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[ProbeHosts]:
    tag = uuid.uuid4().hex[:6]
    n = int(tag[:2], 16)  # one third octet per run: concurrent runs on other hosts never collide
    netns, links = f"aetn-{tag}", [(f"aetq{tag}", f"aetr{tag}"), (f"aetu{tag}", f"aetv{tag}")]
    link_private = (f"172.31.{n}.1", f"172.31.{n}.2")
    link_nodenet = (f"198.19.{n}.1", f"198.19.{n}.2")
    on_lo = {
        "public": f"198.18.{n}.10",
        "public2": f"198.18.{n}.11",
        "rfc1918": f"10.77.{n}.10",
        "rfc1918b": f"192.168.{n}.10",
        "cgnat": f"100.64.{n}.10",
        "linklocal": f"169.254.{n}.10",
    }
    sh("ip", "netns", "add", netns)
    proc = None
    try:
        for (host_if, peer_if), (host_ip, peer_ip) in zip(links, (link_private, link_nodenet), strict=True):
            sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", netns)
            sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
            sh("ip", "link", "set", host_if, "up")
            sh("ip", "-n", netns, "addr", "add", f"{peer_ip}/30", "dev", peer_if)
            sh("ip", "-n", netns, "link", "set", peer_if, "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        for addr in on_lo.values():
            sh("ip", "-n", netns, "addr", "add", f"{addr}/32", "dev", "lo")
            sh("ip", "route", "add", f"{addr}/32", "via", link_private[1])
        # Replies go back to whichever host address the sandbox was masqueraded to.
        sh("ip", "-n", netns, "route", "add", "default", "via", link_private[0])
        port = 19000 + int(tag[2:6], 16) % 2000
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield ProbeHosts(port, {**on_lo, "private": link_private[1], "nodenet": link_nodenet[1]})
    finally:
        if proc:
            proc.kill()
            proc.wait()
        for addr in on_lo.values():
            subprocess.run(["ip", "route", "del", f"{addr}/32"], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for host_if, _ in links:
            subprocess.run(["ip", "link", "del", host_if], capture_output=True)


DENIED_BY_DEFAULT = {"rfc1918", "rfc1918b", "cgnat", "linklocal", "private", "nodenet"}


def expect(open_: set[str], hosts: ProbeHosts) -> dict[str, str]:
    return {name: "OPEN" if name in open_ else "BLOCKED" for name in hosts.addrs}


def test_defaults_deny_private_ranges_and_policy_opens_them_on_a_live_sandbox(
    forkyard_server: ServerProcess, hosts: ProbeHosts
) -> None:
    sbx = Sandbox.create("base", timeout=120)
    try:
        # Internet on (the default): public hosts answer, private ones, link-local, CGNAT and the
        # node's own networks do not.
        assert hosts.probe_in(sbx) == expect({"public", "public2"}, hosts)
        assert sbx.get_info().network in (None, {}) or not sbx.get_info().network.get("allow_out")

        # An explicit allow opens a private host (and only it), live.
        a = hosts.addrs
        sbx.update_network({"allow_out": [a["rfc1918"], f"{a['cgnat']}/32", f"{a['nodenet']}/30"]})
        assert hosts.probe_in(sbx) == expect({"public", "public2", "rfc1918", "cgnat", "nodenet"}, hosts)

        # Deny all with one exception: allow beats deny.
        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [a["public"]]})
        assert hosts.probe_in(sbx) == expect({"public"}, hosts)
        info = sbx.get_info().network or {}
        assert info.get("allow_out") == [f"{a['public']}/32"] and info.get("deny_out") == ["0.0.0.0/0"]

        # A deny of one public host; then an update that leaves everything out clears it all.
        sbx.update_network({"deny_out": [f"{a['public2']}/31"]})
        assert hosts.probe_in(sbx) == expect(set(), hosts)  # 198.18.n.10/31 covers both
        sbx.update_network({})
        assert hosts.probe_in(sbx) == expect({"public", "public2"}, hosts)

        # The policy survives a pause and a resume, and a fork's children inherit it.
        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [a["rfc1918"]]})
        sbx.pause()
        with pytest.raises(SandboxException):  # a paused sandbox's network cannot change (409)
            Sandbox.update_network(sbx.sandbox_id, {"allow_out": []})
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert hosts.probe_in(sbx) == expect({"rfc1918"}, hosts)
        (child,) = sbx.fork(count=1, timeout=60)
        assert isinstance(child, Sandbox), child
        try:
            assert hosts.probe_in(child) == expect({"rfc1918"}, hosts)
            assert (child.get_info().network or {}).get("allow_out") == [f"{a['rfc1918']}/32"]
        finally:
            child.kill()
    finally:
        sbx.kill()


def test_create_with_a_policy_and_without_internet(forkyard_server: ServerProcess, hosts: ProbeHosts) -> None:
    a = hosts.addrs
    only = Sandbox.create(
        "base", timeout=120, network={"deny_out": [ALL_TRAFFIC], "allow_out": [a["public2"], a["private"]]}
    )
    offline = Sandbox.create(
        "base", timeout=120, allow_internet_access=False, network={"allow_out": [a["linklocal"]]}
    )
    try:
        assert hosts.probe_in(only) == expect({"public2", "private"}, hosts)
        # allow_internet_access=False is deny_out=[0.0.0.0/0]: allow_out still opens exceptions.
        assert hosts.probe_in(offline) == expect({"linklocal"}, hosts)
        # An update that turns internet access on again (and clears the exception).
        offline.update_network({"allow_internet_access": True})
        assert hosts.probe_in(offline) == expect({"public", "public2"}, hosts)
    finally:
        only.kill()
        offline.kill()


def test_bad_policies_are_refused_with_400(forkyard_server: ServerProcess) -> None:
    bad_creates = [
        ({"allow_out": ["example.com"]}, "you must include 'ALL_TRAFFIC' in deny out"),
        ({"allow_out": ["bad_name..com"], "deny_out": [ALL_TRAFFIC]}, "invalid allowOut entry"),
        ({"deny_out": ["example.com"]}, "invalid denied CIDR example.com"),
        ({"allow_out": ["10.0.0.300"]}, "invalid allowOut entry"),
        ({"allow_out": ["::1"]}, "IPv4 only"),
        ({"rules": {"api.example.com": [{"transform": {"headers": {"a": "b"}}}]}}, "network.rules"),
        ({"mask_request_host": "evil\r\nX-Injected: 1"}, "mask request host is not valid"),
    ]
    for network, message in bad_creates:
        with pytest.raises(SandboxException, match=re.escape(message)) as refused:
            Sandbox.create("base", timeout=60, network=network)  # type: ignore[arg-type]
        assert str(refused.value).startswith("400: "), refused.value
    assert [s for s in Sandbox.list().next_items()] == [], "a refused create left a sandbox"
    with pytest.raises(NotFoundException):
        Sandbox.update_network("inothere000000000000", {"allow_out": ["1.1.1.1"]})
    sbx = Sandbox.create("base", timeout=60)
    try:
        with pytest.raises(SandboxException, match="400: invalid denied CIDR"):
            sbx.update_network({"deny_out": ["1.2.3.4/33"]})
        assert sbx.commands.run("echo still").stdout == "still\n"
    finally:
        sbx.kill()


ECHO_HOST = textwrap.dedent(
    """
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            names = ",".join(self.headers.keys())  # as sent: E2B's proxy canonicalises them
            body = ((self.headers.get("Host") or "") + chr(10) + names).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
    """
)


def test_private_traffic_needs_the_token_and_the_sandbox_sees_the_masked_host(
    forkyard_server: ServerProcess,
) -> None:
    sbx = Sandbox.create(
        "base",
        timeout=120,
        network={"allow_public_traffic": False, "mask_request_host": "app-${PORT}.example.test:8443"},
    )
    try:
        assert sbx.traffic_access_token
        sbx.files.write("/home/user/echo_host.py", ECHO_HOST)
        sbx.commands.run("python3 /home/user/echo_host.py 8080", background=True)
        wait = "import socket; socket.create_connection(('127.0.0.1', 8080))"
        sbx.commands.run(
            f'for i in $(seq 50); do python3 -c "{wait}" 2>/dev/null && exit 0; sleep 0.1; done; exit 1'
        )
        route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
        denied = httpx.get(forkyard_server.url + "/", headers=route, timeout=10)
        assert denied.status_code == 403 and "e2b-traffic-access-token" in denied.json()["message"]
        wrong = httpx.get(
            forkyard_server.url + "/", headers={**route, "e2b-traffic-access-token": "nope"}, timeout=10
        )
        assert wrong.status_code == 403
        ok = httpx.get(
            forkyard_server.url + "/",
            headers={**route, "e2b-traffic-access-token": sbx.traffic_access_token},
            timeout=10,
        )
        host, names = ok.text.split("\n")
        assert ok.status_code == 200 and host == "app-8080.example.test:8443"
        # E2B's proxy (Go) canonicalises header names; E2B's own suite checks for "Host:".
        assert {"Host", "User-Agent", "X-Forwarded-For", "X-Forwarded-Proto"} <= set(names.split(","))
        # envd's own port needs no traffic token (the SDK reaches it with its envd token).
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        assert (sbx.get_info().network or {}).get("allow_public_traffic") is False
    finally:
        sbx.kill()


def test_policy_survives_a_server_restart(hosts: ProbeHosts) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="aenp-", dir="/tmp"))
    server = start_server(data_dir)
    opts = server.sdk_opts
    try:
        a = hosts.addrs
        sbx = Sandbox.create("base", timeout=120, network={"allow_out": [a["cgnat"]]}, **opts)
        server.kill_hard()
        server = start_server(data_dir, port=server.port, api_key=server.api_key)
        again = Sandbox.connect(sbx.sandbox_id, **opts)
        assert (again.get_info().network or {}).get("allow_out") == [f"{a['cgnat']}/32"]
        assert hosts.probe_in(again) == expect({"public", "public2", "cgnat"}, hosts)
        again.update_network({"allow_out": [a["rfc1918b"]]})
        assert hosts.probe_in(again) == expect({"public", "public2", "rfc1918b"}, hosts)
        again.kill()
    finally:
        server.kill_all_sandboxes()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_js_sdk_network_policy(forkyard_server: ServerProcess, hosts: ProbeHosts) -> None:
    js = TESTS / "js"
    if shutil.which("node") is None:
        pytest.fail("node is not installed (scripts/bootstrap.sh --test installs it)")
    if not (js / "node_modules" / "e2b").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=js, check=True)
    env = {
        **os.environ,
        **forkyard_server.sdk_env,
        "TEST_PORT": str(hosts.port),
        "TEST_PUBLIC": hosts.addrs["public"],
        "TEST_PUBLIC2": hosts.addrs["public2"],
        "TEST_PRIVATE": hosts.addrs["rfc1918"],
    }
    proc = subprocess.run(
        ["node", "network_policy.mjs"], cwd=js, capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    pub, pub2, priv = hosts.addrs["public"], hosts.addrs["public2"], hosts.addrs["rfc1918"]
    assert out["created"] == {pub: "OPEN", pub2: "BLOCKED", priv: "BLOCKED"}
    assert out["info"] == {"allowOut": [f"{pub}/32"], "denyOut": ["0.0.0.0/0"]}
    assert out["updated"] == {pub: "OPEN", pub2: "OPEN", priv: "OPEN"}
    assert "ALL_TRAFFIC" in out["refused"], out["refused"]
