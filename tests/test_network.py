"""agentenv.runtime.network on the real kernel: netns, veth, iptables, slots (no runsc needed).

The sandbox side is driven with ``ip netns exec`` (the host kernel's stack inside the netns),
which is what a microVM runtime's tap and gVisor's netstack both sit behind.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from conftest import unique_id

from agentenv.config import Settings
from agentenv.runtime import network
from agentenv.runtime.network import NetworkError, SandboxNetwork

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and iptables need root"),
]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # Its own /20 so these links never share addresses with sandboxes of other tests.
    return Settings(data_dir=tmp_path, sandbox_subnet="10.213.96.0/20")


@pytest_asyncio.fixture(loop_scope="session")
async def nets(settings: Settings) -> AsyncIterator[list[SandboxNetwork]]:
    created: list[SandboxNetwork] = []
    yield created
    for net in created:
        await network.teardown_network(settings, net.sandbox_id, net)


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def connect_in(netns: str, host: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1.5)"
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code],
                          capture_output=True).returncode == 0


def resources(net: SandboxNetwork) -> dict[str, bool]:
    rules = sh("iptables-save") + sh("iptables-save", "-t", "nat")
    return {
        "netns": Path(net.netns_path).exists(),
        "host_if": Path(f"/sys/class/net/{net.host_if}").exists(),
        "rules": f"--comment {net.netns} " in rules + " ",
    }


async def test_slot_addresses() -> None:
    s = Settings(sandbox_subnet="10.213.0.0/16")
    assert network.slot_addresses(s, 1) == ("10.213.0.5", "10.213.0.6")
    assert network.slot_addresses(s, 64) == ("10.213.1.1", "10.213.1.2")
    assert network.slot_count(s) == 16384
    with pytest.raises(NetworkError):
        network.slot_addresses(s, 16384)
    with pytest.raises(NetworkError, match="too small"):
        network.slot_addresses(Settings(sandbox_subnet="10.213.0.0/31"), 0)


async def test_setup_and_teardown(settings: Settings, nets: list[SandboxNetwork]) -> None:
    sid = unique_id("n")
    net = await network.setup_network(settings, sid, allow_internet_access=False)
    nets.append(net)
    assert net.netns == f"ae-{sid}" and net.host_if == f"aeh{net.slot}" and net.sandbox_if == f"aes{net.slot}"
    assert resources(net) == {"netns": True, "host_if": True, "rules": True}
    inside = sh("ip", "-n", net.netns, "-o", "addr")
    assert f"{net.sandbox_ip}/30" in inside and "lo" in inside and "127.0.0.1" in inside
    assert f"default via {net.host_ip}" in sh("ip", "-n", net.netns, "route")
    assert network.list_orphans(settings, set()) == [sid] and network.list_orphans(settings, {sid}) == []

    await network.teardown_network(settings, sid)  # without the dataclass: found by its slot claim
    assert resources(net) == {"netns": False, "host_if": False, "rules": False}
    assert network.claimed_slots(settings) == {}
    await network.teardown_network(settings, sid, net)  # idempotent


async def test_filtering(settings: Settings, nets: list[SandboxNetwork]) -> None:
    off = await network.setup_network(settings, unique_id("off"), allow_internet_access=False)
    nets.append(off)
    on = await network.setup_network(settings, unique_id("on"), allow_internet_access=True)
    nets.append(on)
    host = socket.socket()
    host.bind(("0.0.0.0", 0))
    host.listen()
    port = host.getsockname()[1]
    server = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", off.netns, sys.executable, "-c",
        "import socket,time; s=socket.socket(); s.bind(('0.0.0.0', 7001)); s.listen(); time.sleep(60)",
    )
    try:
        await asyncio.sleep(0.5)
        # host -> sandbox works (that is how the host reaches envd) ...
        await asyncio.to_thread(socket.create_connection, (off.sandbox_ip, 7001), 2)
        # ... sandbox -> host does not, on the sandbox's gateway or any other host address ...
        for net in (off, on):
            assert not await asyncio.to_thread(connect_in, net.netns, net.host_ip, port)
        assert not await asyncio.to_thread(connect_in, on.netns, off.host_ip, port)
        # ... nor sandbox -> sandbox.
        assert not await asyncio.to_thread(connect_in, on.netns, off.sandbox_ip, 7001)
        nat = sh("iptables", "-t", "nat", "-S", network.CHAIN)
        assert f"-s {on.sandbox_ip}/32" in nat and off.sandbox_ip not in nat
        assert sh("sysctl", "-n", "net.ipv4.ip_forward").strip() == "1"
    finally:
        server.kill()
        await server.wait()
        host.close()


async def test_concurrent_setups_in_one_and_many_processes(
    settings: Settings, nets: list[SandboxNetwork]
) -> None:
    ids = [unique_id("c") for _ in range(4)]
    results = await asyncio.gather(
        *(network.setup_network(settings, sid, allow_internet_access=False) for sid in ids)
    )
    nets.extend(results)
    code = (
        "import asyncio, sys\n"
        "from agentenv.config import Settings\n"
        "from agentenv.runtime import network\n"
        "s = Settings(data_dir=sys.argv[1], sandbox_subnet=sys.argv[2])\n"
        "print(asyncio.run(network.setup_network(s, sys.argv[3], allow_internet_access=False)).slot)\n"
    )
    others = [unique_id("p") for _ in range(3)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, str(settings.data_dir), settings.sandbox_subnet, sid,
            stdout=asyncio.subprocess.PIPE,
        )
        for sid in others
    ]
    outputs = [await p.communicate() for p in procs]
    slots = [r.slot for r in results] + [int(out) for out, _ in outputs]
    assert len(set(slots)) == len(slots) == 7
    claimed = network.claimed_slots(settings)
    for sid in others:
        await network.teardown_network(settings, sid)
    assert sorted(claimed) == sorted(ids + others)


async def test_invalid_sandbox_id(settings: Settings) -> None:
    with pytest.raises(NetworkError, match="invalid sandbox id"):
        await network.setup_network(settings, "../x", allow_internet_access=False)
