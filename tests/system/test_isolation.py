"""What one gVisor sandbox must not reach: host processes and files, other sandboxes, the network.

The "internet" is a test host: a TCP server in a network namespace this test creates, routed
from the host over its own veth (10.213.127.252/30, outside the sandboxes' 10.213.128.0/17), so
no packet leaves the machine. Sandboxes reach it at a public-range address on its loopback
(198.18.127.254, RFC 2544's benchmarking range): private ranges are denied by default.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from forkyard.config import Settings
from forkyard.runtime.gvisor.runtime import GvisorRuntime
from forkyard.types import SandboxInstance, SandboxNetwork, SandboxSpec, TemplateImage
from tests.support import SHARED_TEMPLATES, unique_id
from tests.system.test_gvisor import leftovers, run

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.requires_root("gVisor sandboxes and a fake internet host (netns, veth, iptables)"),
]

SANDBOX_SUBNET = "10.213.128.0/17"
TEST_HOST_LINK = ("10.213.127.253", "10.213.127.254")  # host side, test-host side
TEST_HOST_PUBLIC = "198.18.127.254"


@pytest.fixture(scope="module")
def iso_settings() -> Iterator[Settings]:
    data_dir = Path(tempfile.mkdtemp(prefix="aei-", dir="/tmp"))
    settings = Settings(data_dir=data_dir, templates_path=SHARED_TEMPLATES, sandbox_subnet=SANDBOX_SUBNET)
    yield settings
    leaked = asyncio.run(GvisorRuntime(settings).cleanup_orphans(set()))
    shutil.rmtree(data_dir, ignore_errors=True)
    assert not leaked, leaked


@pytest.fixture(scope="module")
def gvisor(iso_settings: Settings) -> GvisorRuntime:
    runtime = GvisorRuntime(iso_settings)
    reason = runtime.probe()
    if reason:
        pytest.skip(reason)
    return runtime


@dataclass
class FakeInternetHost:
    netns: str
    host_if: str
    address: str
    port: int
    proc: subprocess.Popen[bytes]


SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"pong"); c.close()
"""


@pytest.fixture(scope="module")
def test_host() -> Iterator[FakeInternetHost]:
    tag = uuid.uuid4().hex[:6]
    netns, host_if, peer_if = f"aetn-{tag}", f"aeth{tag}", f"aetp{tag}"
    host_ip, peer_ip = TEST_HOST_LINK

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    sh("ip", "netns", "add", netns)
    proc = None
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", netns)
        sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", netns, "addr", "add", f"{peer_ip}/30", "dev", peer_if)
        sh("ip", "-n", netns, "link", "set", peer_if, "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        sh("ip", "-n", netns, "addr", "add", f"{TEST_HOST_PUBLIC}/32", "dev", "lo")
        sh("ip", "-n", netns, "route", "add", "default", "via", host_ip)
        sh("ip", "route", "replace", f"{TEST_HOST_PUBLIC}/32", "via", peer_ip)
        port = 18000 + int(tag[:4], 16) % 2000
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        with socket.create_connection((TEST_HOST_PUBLIC, port), timeout=3) as c:  # routed from the host
            assert c.recv(4) == b"pong"
        yield FakeInternetHost(netns, host_if, TEST_HOST_PUBLIC, port, proc)
    finally:
        if proc:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "route", "del", f"{TEST_HOST_PUBLIC}/32"], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


@pytest.fixture(scope="module")
def host_listener() -> Iterator[int]:
    """A TCP server on every host address (including each sandbox's gateway address)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    yield srv.getsockname()[1]
    srv.close()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def offline(gvisor: GvisorRuntime, base_template: TemplateImage) -> AsyncIterator[SandboxInstance]:
    spec = SandboxSpec(sandbox_id=unique_id("off"), template=base_template, allow_internet_access=False)
    instance = await gvisor.create(spec)
    yield instance
    await gvisor.kill(instance)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def online(gvisor: GvisorRuntime, base_template: TemplateImage) -> AsyncIterator[SandboxInstance]:
    spec = SandboxSpec(sandbox_id=unique_id("on"), template=base_template, allow_internet_access=True)
    instance = await gvisor.create(spec)
    yield instance
    await gvisor.kill(instance)


CONNECT = """python3 - {host} {port} <<'EOF'
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
except OSError as e:
    print("BLOCKED", e)
    sys.exit(0)
s.settimeout(1)
try:
    data = s.recv(4)
except OSError:
    data = b""
print("OPEN", data)
EOF"""


def command_output(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


async def connect_from(instance: SandboxInstance, host: str, port: int) -> str:
    code, out = await run(instance, CONNECT.format(host=host, port=port))
    assert code == 0, out
    return out.strip()


async def test_cannot_see_host_processes(offline: SandboxInstance) -> None:
    marker = f"aet-canary-{uuid.uuid4().hex}"
    host_proc = await asyncio.create_subprocess_exec("python3", "-c", "import time; time.sleep(300)", marker)
    try:
        _, out = await run(offline, f"grep -l {marker} /proc/*/cmdline 2>/dev/null; ls /proc")
        assert marker not in out
        pids = [int(p) for p in out.split() if p.isdigit()]
        assert len(pids) < 20, f"sandbox sees {len(pids)} processes: {pids}"
        _, out = await run(offline, "cat /proc/1/cmdline | tr '\\0' ' '")
        assert "forkyard.envd" in out, out  # pid 1 is envd, not the host's init
    finally:
        host_proc.kill()
        await host_proc.wait()


async def test_cannot_read_host_files(offline: SandboxInstance, gvisor: GvisorRuntime) -> None:
    secret = uuid.uuid4().hex
    canaries = [Path(f"/aet-canary-{secret[:8]}"), Path(tempfile.gettempdir()) / f"aet-canary-{secret[:8]}"]
    for path in canaries:
        path.write_text(secret)
    try:
        paths = " ".join(str(p) for p in canaries)
        probes = (
            f"cat {paths} /proc/1/root{canaries[0]} 2>&1; "
            f"grep -rs {secret} /proc/self/root/etc /root /tmp 2>/dev/null | head -1; "
            f"cat /proc/mounts"
        )
        _, out = await run(offline, probes)
        assert secret not in out, out
        # The data directory (other sandboxes' layers, the runsc state) is not mounted either.
        assert str(gvisor.settings.data_dir) not in out
    finally:
        for path in canaries:
            path.unlink(missing_ok=True)


async def test_cannot_see_other_sandbox(offline: SandboxInstance, online: SandboxInstance) -> None:
    secret = uuid.uuid4().hex
    background = f"(sleep 300 {secret} >/dev/null 2>&1 &)"  # must not hold the command's stdout
    code, out = await run(online, f"echo {secret} > /home/user/{secret}; {background}; echo ok")
    assert code == 0, out
    code, out = await run(offline, "ls /home/user; cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '")
    assert secret not in out, out
    # ... and cannot reach it over the network either (sandbox -> sandbox is dropped).
    assert (await connect_from(offline, online.address, 49983)).startswith("BLOCKED")
    assert (await connect_from(online, offline.address, 49983)).startswith("BLOCKED")


async def test_offline_sandbox_reaches_nothing(
    offline: SandboxInstance, test_host: FakeInternetHost, host_listener: int
) -> None:
    gateway = _link(offline).host_ip
    assert (await connect_from(offline, test_host.address, test_host.port)).startswith("BLOCKED")
    assert (await connect_from(offline, gateway, host_listener)).startswith("BLOCKED")
    assert (await connect_from(offline, "127.0.0.1", 49983)).startswith("OPEN")  # its own loopback


async def test_online_sandbox_reaches_internet_but_not_host(
    online: SandboxInstance, test_host: FakeInternetHost, host_listener: int
) -> None:
    gateway = _link(online).host_ip
    assert await connect_from(online, test_host.address, test_host.port) == "OPEN b'pong'"
    assert (await connect_from(online, gateway, host_listener)).startswith("BLOCKED")
    # The host itself still talks to envd in both directions of that connection.
    with socket.create_connection((online.address, 49983), timeout=3):
        pass


async def test_kill_leaves_nothing(gvisor: GvisorRuntime, base_template: TemplateImage) -> None:
    for internet in (False, True):
        spec = SandboxSpec(sandbox_id=unique_id("kl"), template=base_template, allow_internet_access=internet)
        instance = await gvisor.create(spec)
        try:
            code, out = await run(instance, "echo x > /home/user/f; (sleep 1000 >/dev/null 2>&1 &); echo ok")
            assert code == 0, out
        finally:
            await gvisor.kill(instance)
        assert leftovers(gvisor, spec.sandbox_id) == {}
        rules = await asyncio.to_thread(command_output, "iptables-save")
        assert f"ae-{spec.sandbox_id}" not in rules
        ip_link = await asyncio.to_thread(command_output, "ip", "-o", "link")
        assert f"aeh{_link(instance).slot}:" not in ip_link


def _link(instance: SandboxInstance) -> SandboxNetwork:
    assert instance.network is not None
    return instance.network
