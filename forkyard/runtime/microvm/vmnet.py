"""The tap device a microVM (QEMU or Firecracker) plugs into, inside the sandbox's netns.

:mod:`forkyard.runtime.network` gives each sandbox ``netns ae-<id>`` with ``aes<slot>`` holding
the sandbox address. A VM cannot take that interface over (gVisor's netstack can), so inside the
netns we add::

    aes<slot> sandbox_ip/30  --(netns routing + NAT)-->  tap0 GUEST_GATEWAY/30  <-->  guest eth0 GUEST_IP

and every guest uses the SAME fixed address ``GUEST_IP``: traffic the host sends to
``sandbox_ip`` is DNAT-ed to the guest, traffic the guest sends out is masqueraded to
``sandbox_ip``. A snapshot restored or forked into another netns (another slot, another
sandbox address) therefore keeps working without reconfiguring the guest kernel. The guest
addresses are those of slot 0 of the sandbox subnet, which :mod:`network` never hands out, and
they exist only inside each sandbox's own netns. Deleting the netns removes all of it.
"""

from __future__ import annotations

import ipaddress

from forkyard.config import Settings
from forkyard.runtime import network
from forkyard.runtime.network import SandboxNetwork

TAP_NAME = "tap0"
#: Fixed MAC of every guest's eth0 (locally administered); unique per netns is all that matters.
GUEST_MAC = "02:ae:00:00:00:02"


def guest_addresses(settings: Settings) -> tuple[str, str]:
    """(gateway inside the netns, guest address): slot 0 of the sandbox subnet."""
    net = ipaddress.ip_network(settings.sandbox_subnet)
    base = int(net.network_address)
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


async def add_tap(settings: Settings, net: SandboxNetwork, *, device: bool = True) -> str:
    """Create ``tap0`` in the sandbox's netns, routed and NAT-ed to the sandbox address; without
    ``device`` only the routing and NAT (a pre-started VMM brings its tap, :func:`adopt_tap`).

    Two processes (one ``ip -batch``, one shell running sysctl + ``iptables-restore``) instead of
    one per command: process start-up is most of what network set-up costs a restore."""
    gateway, guest = guest_addresses(settings)
    if device:
        links = f"tuntap add dev {TAP_NAME} mode tap\n" + _tap_address(gateway)
        await network.run("ip", "-n", net.netns, "-batch", "-", input=links)
    rules = (
        "*nat\n"
        f"-A PREROUTING -i {net.sandbox_if} -j DNAT --to-destination {guest}\n"
        f"-A POSTROUTING -o {net.sandbox_if} -j MASQUERADE\n"
        "COMMIT\n"
    )
    # The xtables lock is host-wide, even for a netns of its own: wait for it (-w).
    script = "sysctl -q -w net.ipv4.ip_forward=1 && iptables-restore -w 10 --noflush"
    await network.run("ip", "netns", "exec", net.netns, "sh", "-c", script, input=rules)
    return TAP_NAME


def _tap_address(gateway: str) -> str:
    return f"addr add {gateway}/30 dev {TAP_NAME}\nlink set {TAP_NAME} up\n"


async def add_host_tap(name: str) -> None:
    """A persistent tap in the host's netns for a VMM started before its sandbox exists: the
    VMM opens it at start, :func:`adopt_tap` later moves it (still open) into the sandbox's netns."""
    await network.run("ip", "tuntap", "add", "dev", name, "mode", "tap")


async def remove_host_tap(name: str) -> None:
    await network.run("ip", "link", "del", name, check=False)


async def adopt_tap(settings: Settings, net: SandboxNetwork, host_tap: str, *, replace: bool) -> None:
    """Move ``host_tap`` (a pre-started VMM holds it open) into the sandbox's netns as ``tap0``
    with the gateway address; ``replace``: a ``tap0`` is there already (a paused sandbox's
    network keeps its own) and goes first. Routing and NAT name the sandbox interface, not the
    tap: they stay. The move is one netlink request, but the kernel's netns change costs
    ~15 ms of it (RCU grace periods), about half what it saves by not starting QEMU."""
    gateway, _ = guest_addresses(settings)
    if replace:
        await network.run("ip", "-n", net.netns, "link", "del", TAP_NAME)
    await network.run("ip", "link", "set", "dev", host_tap, "netns", net.netns, "name", TAP_NAME)
    await network.run("ip", "-n", net.netns, "-batch", "-", input=_tap_address(gateway))
