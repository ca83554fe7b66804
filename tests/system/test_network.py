"""forkyard.runtime.network on the real kernel: netns, veth, iptables, slots (no runsc needed).

The sandbox side is driven with ``ip netns exec`` (the host kernel's stack inside the netns),
which is what a microVM runtime's tap and gVisor's netstack both sit behind.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.runtime import egress_policy, egress_proxy, network
from forkyard.runtime.network import NetworkError, SandboxNetwork
from tests.support import unique_id

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.requires_root("network namespaces and iptables"),
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
    return (
        subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c", code], capture_output=True
        ).returncode
        == 0
    )


def tagged_rules(net: SandboxNetwork) -> dict[str, list[str]]:
    """table -> the rules of chain FORKYARD tagged with ``net``'s netns, as ``iptables -S`` shows them
    (``nat-pre``: those of FORKYARD-PRE, the nat PREROUTING chain)."""
    chains = {
        "filter": ("filter", network.CHAIN),
        "nat": ("nat", network.CHAIN),
        "nat-pre": ("nat", network.PRE_CHAIN),
    }
    return {
        key: [
            line
            for line in sh("iptables", "-t", table, "-S", chain).splitlines()
            if f"--comment {net.netns} " in line + " " or f'--comment "{net.netns}" ' in line + " "
        ]
        for key, (table, chain) in chains.items()
    }


def expected_rules(net: SandboxNetwork, subnet: str) -> dict[str, list[str]]:
    tag = f"-m comment --comment {net.netns}"
    hif = net.host_if
    filter_rules = [
        f"-A FORKYARD -i {hif} -m conntrack --ctstate RELATED,ESTABLISHED {tag} -j ACCEPT",
        # Only what the redirect chain sent to the egress proxy enters the host.
        f"-A FORKYARD -i {hif} -p tcp -m conntrack --ctstate DNAT --ctorigdstport 80 {tag} -j ACCEPT",
        f"-A FORKYARD -i {hif} -p tcp -m conntrack --ctstate DNAT --ctorigdstport 443 {tag} -j ACCEPT",
        f"-A FORKYARD -i {hif} -m addrtype --dst-type LOCAL {tag} -j DROP",
        f"-A FORKYARD -d {subnet} -i {hif} {tag} -j DROP",
        f"-A FORKYARD -i {hif} {tag} -j {network.egress_chain(net)}",
        f"-A FORKYARD -o {hif} -m conntrack --ctstate RELATED,ESTABLISHED {tag} -j ACCEPT",
        f"-A FORKYARD -o {hif} {tag} -j DROP",
    ]
    nat = [f"-A FORKYARD -s {net.sandbox_ip}/32 ! -d {subnet} {tag} -j MASQUERADE"]
    pre = [f"-A FORKYARD-PRE -i {hif} -p tcp {tag} -j {network.redirect_chain(net)}"]
    return {"filter": filter_rules, "nat": nat, "nat-pre": pre}


def expected_egress(net: SandboxNetwork) -> list[str]:
    """The sandbox's egress chain with no policy: defaults denied, then its internet switch."""
    chain = network.egress_chain(net)
    denied = dict.fromkeys([*network.DEFAULT_DENIED, *network.node_networks()])
    return [
        f"-N {chain}",
        *(f"-A {chain} -d {cidr} -j DROP" for cidr in denied),
        f"-A {chain} -j {'ACCEPT' if net.allow_internet_access else 'DROP'}",
    ]


def netns_exists(sandbox_id: str) -> bool:
    return (network.NETNS_DIR / network.netns_name(sandbox_id)).exists()


def assert_gone(settings: Settings, net: SandboxNetwork) -> None:
    everything = sh("iptables-save")
    assert f"--comment {net.netns}" not in everything and f'--comment "{net.netns}"' not in everything
    assert f":{network.egress_chain(net)} " not in everything
    assert f":{network.redirect_chain(net)} " not in everything
    assert not Path(net.netns_path).exists()
    assert not Path(f"/sys/class/net/{net.host_if}").exists()
    assert net.sandbox_id not in network.claimed_slots(settings)


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
        "ip",
        "netns",
        "exec",
        off.netns,
        sys.executable,
        "-c",
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
        # Both are masqueraded (an offline sandbox's allowOut exceptions leave too); the egress
        # chain decides, and the offline one's ends in a drop.
        assert f"-s {on.sandbox_ip}/32" in nat and f"-s {off.sandbox_ip}/32" in nat
        assert sh("iptables", "-S", network.egress_chain(off)).splitlines()[-1].endswith("-j DROP")
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
        "from forkyard.config import Settings\n"
        "from forkyard.runtime import network\n"
        "s = Settings(data_dir=sys.argv[1], sandbox_subnet=sys.argv[2])\n"
        "print(asyncio.run(network.setup_network(s, sys.argv[3], allow_internet_access=False)).slot)\n"
    )
    others = [unique_id("p") for _ in range(3)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            str(settings.data_dir),
            settings.sandbox_subnet,
            sid,
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
    with pytest.raises(Invalid, match="invalid sandbox id"):
        await network.setup_network(settings, "../x", allow_internet_access=False)


@pytest.mark.parametrize("internet", [False, True])
async def test_exact_state_after_setup_and_nothing_after_teardown(
    settings: Settings, nets: list[SandboxNetwork], internet: bool
) -> None:
    net = await network.setup_network(settings, unique_id("x"), allow_internet_access=internet)
    nets.append(net)
    assert tagged_rules(net) == expected_rules(net, settings.sandbox_subnet)
    assert sh("iptables", "-S", network.egress_chain(net)).splitlines() == expected_egress(net)
    # Without domain rules the redirect chain is empty: nothing goes to the egress proxy.
    redirect = network.redirect_chain(net)
    assert sh("iptables", "-t", "nat", "-S", redirect).splitlines() == [f"-N {redirect}"]
    assert (
        "-A PREROUTING -i aeh+ -j FORKYARD-PRE"
        in sh("iptables", "-t", "nat", "-S", "PREROUTING").splitlines()
    )
    # The hooks into the chains (shared by every sandbox) are there.
    assert "-A INPUT -i aeh+ -j FORKYARD" in sh("iptables", "-S", "INPUT").splitlines()
    assert "-A FORWARD -j FORKYARD" in sh("iptables", "-S", "FORWARD").splitlines()
    assert "-A POSTROUTING -j FORKYARD" in sh("iptables", "-t", "nat", "-S", "POSTROUTING").splitlines()
    host = sh("ip", "-o", "-4", "addr", "show", "dev", net.host_if).split()
    assert host[host.index("inet") + 1] == f"{net.host_ip}/30"
    assert "LOWER_UP" in sh("ip", "link", "show", net.host_if)
    inside = [line.split() for line in sh("ip", "-n", net.netns, "-o", "-4", "addr").splitlines()]
    assert sorted((f[1], f[3]) for f in inside) == [
        (net.sandbox_if, f"{net.sandbox_ip}/30"),
        ("lo", "127.0.0.1/8"),
    ]
    links = sh("ip", "-n", net.netns, "-o", "link")
    assert all(",UP" in line or "<UP" in line for line in links.splitlines()), links
    assert sh("ip", "-n", net.netns, "route").splitlines()[0].split()[:5] == [
        "default",
        "via",
        net.host_ip,
        "dev",
        net.sandbox_if,
    ]

    await network.teardown_network(settings, net.sandbox_id, net)
    assert_gone(settings, net)


async def test_concurrent_setups_and_teardowns_share_rule_commits(
    settings: Settings, nets: list[SandboxNetwork], monkeypatch: pytest.MonkeyPatch
) -> None:
    restores: list[dict[str, list[str]]] = []
    real = network._iptables_restore

    async def counting(script: dict[str, list[str]], *, check: bool = True) -> tuple[int, str]:
        restores.append(script)
        return await real(script, check=check)

    monkeypatch.setattr(network, "_iptables_restore", counting)
    count = 8
    ids = [unique_id("g") for _ in range(count)]
    created = await asyncio.gather(
        *(network.setup_network(settings, sid, allow_internet_access=i % 2 == 0) for i, sid in enumerate(ids))
    )
    nets.extend(created)
    # Setups whose rules are ready while one restore runs go into the next one together (how
    # many do depends on timing: at most one restore each).
    assert 1 <= len(restores) <= count
    for net in created:
        assert tagged_rules(net) == expected_rules(net, settings.sandbox_subnet)
    restores.clear()
    await asyncio.gather(*(network.teardown_network(settings, n.sandbox_id, n) for n in created))
    # The teardowns all ask at once: one restore deletes the rules of every sandbox.
    assert len(restores) == 1
    assert sorted(restores[0]["filter"]) == sorted(
        [
            f"-D FORKYARD {' '.join(rule)}"
            for n in created
            for rule in network.sandbox_rules(n, settings.sandbox_subnet)["filter"]
        ]
        + [f"{op} {network.egress_chain(n)}" for n in created for op in ("-F", "-X")]
    )
    for net in created:
        assert_gone(settings, net)


async def test_rules_committed_in_part_are_not_doubled(
    settings: Settings, nets: list[SandboxNetwork], monkeypatch: pytest.MonkeyPatch
) -> None:
    """iptables-restore commits table by table: when the nat table fails after the filter table
    went in, the retry must not add the filter rules a second time."""
    real = network._iptables_restore
    failed: list[bool] = []

    async def filter_only_once(script: dict[str, list[str]], *, check: bool = True) -> tuple[int, str]:
        if not failed and any(line.startswith("-A ") for line in script.get("nat", [])):
            failed.append(True)
            await real({"filter": script["filter"]})
            return 1, "iptables-restore: line 12 failed (simulated)"
        return await real(script, check=check)

    monkeypatch.setattr(network, "_iptables_restore", filter_only_once)
    net = await network.setup_network(settings, unique_id("h"), allow_internet_access=True)
    nets.append(net)
    assert failed
    assert tagged_rules(net) == expected_rules(net, settings.sandbox_subnet)
    await network.teardown_network(settings, net.sandbox_id, net)
    assert_gone(settings, net)


async def test_failed_setup_leaves_nothing(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    real = network._iptables_restore
    seen: list[SandboxNetwork] = []
    configure = network._configure_netns

    async def remember(net: SandboxNetwork) -> None:
        seen.append(net)
        await configure(net)

    async def nat_always_fails(script: dict[str, list[str]], *, check: bool = True) -> tuple[int, str]:
        if any(line.startswith("-A ") for line in script.get("nat", [])):
            await real({"filter": script["filter"]})
            if check:
                raise NetworkError("iptables-restore failed (simulated)")
            return 1, "simulated"
        return await real(script, check=check)

    monkeypatch.setattr(network, "_configure_netns", remember)
    monkeypatch.setattr(network, "_iptables_restore", nat_always_fails)
    with pytest.raises(NetworkError, match="simulated"):
        await network.setup_network(settings, unique_id("f"), allow_internet_access=True)
    assert len(seen) == 1
    assert_gone(settings, seen[0])

    async def netns_fails(net: SandboxNetwork) -> None:
        seen.append(net)
        raise NetworkError("ip -n failed (simulated)")

    monkeypatch.setattr(network, "_configure_netns", netns_fails)
    with pytest.raises(NetworkError, match="simulated"):
        await network.setup_network(settings, unique_id("f"), allow_internet_access=False)
    assert_gone(settings, seen[1])


async def test_cancelled_setup_leaves_nothing(settings: Settings) -> None:
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.04):
        sid = unique_id("k")
        task = asyncio.create_task(network.setup_network(settings, sid, allow_internet_access=True))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            net = await task
        except asyncio.CancelledError:
            assert not netns_exists(sid)
            assert sid not in network.claimed_slots(settings)
            assert f"ae-{sid}" not in sh("iptables-save")
        else:  # finished before the cancel arrived
            await network.teardown_network(settings, sid, net)
            assert_gone(settings, net)


async def test_existing_netns_is_not_taken_over(settings: Settings) -> None:
    sid = unique_id("e")
    sh("ip", "netns", "add", network.netns_name(sid))
    try:
        with pytest.raises(NetworkError, match="netns add"):
            await network.setup_network(settings, sid, allow_internet_access=False)
        assert netns_exists(sid)
        assert network.claimed_slots(settings) == {}
        assert f"ae-{sid}" not in sh("iptables-save")
    finally:
        sh("ip", "netns", "del", network.netns_name(sid))


async def test_readdress(settings: Settings, nets: list[SandboxNetwork]) -> None:
    net = await network.setup_network(settings, unique_id("r"), allow_internet_access=False)
    nets.append(net)
    sh("ip", "-n", net.netns, "addr", "flush", "dev", net.sandbox_if)  # what runsc does to it
    assert "default" not in sh("ip", "-n", net.netns, "route")
    for _ in range(2):  # replaces: twice is fine
        await network.readdress(net)
        inside = sh("ip", "-n", net.netns, "-o", "addr", "show", "dev", net.sandbox_if)
        assert f"{net.sandbox_ip}/30" in inside
        assert f"default via {net.host_ip} dev {net.sandbox_if}" in sh("ip", "-n", net.netns, "route")


async def test_domain_rules_redirect_to_the_proxy_and_updates_replace_them(
    settings: Settings, nets: list[SandboxNetwork]
) -> None:
    policy = egress_policy.parse_egress(["example.com", "198.51.100.0/24"], ["0.0.0.0/0"])
    net = await network.setup_network(settings, unique_id("d"), allow_internet_access=True, egress=policy)
    nets.append(net)
    try:
        proxy = await egress_proxy.ensure_started(settings)
        redirect = network.redirect_chain(net)
        assert sh("iptables", "-t", "nat", "-S", redirect).splitlines() == [
            f"-N {redirect}",
            f"-A {redirect} -m addrtype --dst-type LOCAL -j RETURN",
            f"-A {redirect} -d {settings.sandbox_subnet} -j RETURN",
            f"-A {redirect} -d 198.51.100.0/24 -j RETURN",
            f"-A {redirect} -p tcp -m multiport --dports 80,443 -j REDIRECT --to-ports {proxy.port}",
        ]
        egress = sh("iptables", "-S", network.egress_chain(net))
        assert f"-A {network.egress_chain(net)} -d 8.8.8.8/32 -p udp -m udp --dport 53 -j ACCEPT" in egress
        published = proxy.policy_for(net.sandbox_ip)
        assert published is not None and published.domains == ("example.com",)

        await network.update_egress(
            settings, net, allow_internet_access=True, egress=egress_policy.parse_egress(["1.2.3.4"], None)
        )
        assert sh("iptables", "-t", "nat", "-S", redirect).splitlines() == [f"-N {redirect}"]
        assert proxy.policy_for(net.sandbox_ip) is None
        await network.update_egress(settings, net, allow_internet_access=False, egress=policy)
        assert len(sh("iptables", "-t", "nat", "-S", redirect).splitlines()) == 5
        assert proxy.policy_for(net.sandbox_ip) is not None

        await network.teardown_network(settings, net.sandbox_id, net)
        assert_gone(settings, net)
        assert proxy.policy_for(net.sandbox_ip) is None
        assert not egress_proxy.has_policies(settings)
    finally:
        await egress_proxy.stop()


async def test_set_up_readdress_and_teardown_start_no_ip_process(
    settings: Settings, nets: list[SandboxNetwork], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The netns, veth, addresses and route are netlink from the server: the only processes a
    sandbox's network starts are the (shared) iptables-restore commits (it started three `ip`
    processes per fork child: host side, netns side, the restore's readdress; one per teardown)."""
    started: list[str] = []
    real = asyncio.create_subprocess_exec

    async def recording(*cmd: str, **kwargs: Any) -> asyncio.subprocess.Process:
        started.append(Path(cmd[0]).name)
        return await real(*cmd, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording)
    net = await network.setup_network(settings, unique_id("np"), allow_internet_access=True)
    nets.append(net)
    await network.readdress(net)
    assert f"{net.sandbox_ip}/30" in sh("ip", "-n", net.netns, "-o", "addr", "show", "dev", net.sandbox_if)
    await network.teardown_network(settings, net.sandbox_id, net)
    assert resources(net) == {"netns": False, "host_if": False, "rules": False}
    assert started == ["iptables-restore", "iptables-restore"]
