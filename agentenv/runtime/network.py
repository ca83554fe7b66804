"""Per-sandbox networking shared by every runtime: a network namespace, a veth link, iptables.

Each sandbox gets::

    host netns                         netns ae-<sandbox_id>
    aeh<slot>  host_ip/30   <--veth-->  aes<slot>  sandbox_ip/30, default via host_ip, lo up

gVisor (``--network sandbox``) takes ``aes<slot>`` and its address into its own netstack; a
microVM runtime puts a tap device into the netns and bridges/routes it there. The host reaches
envd at ``sandbox_ip:49983`` through the host side of the link.

Slots index /30 blocks of ``settings.sandbox_subnet`` (slot n: host .4n+1, sandbox .4n+2). A
slot is claimed by creating ``{data_dir}/net/slot-<n>`` with O_EXCL (atomic across threads and
processes); the claim is skipped when the interface name already exists on the host (another
data directory on the same machine) and retried when ``ip link add`` loses a race.

Filtering, in chain ``AGENTENV`` (jumped to from INPUT for ``aeh+`` and from FORWARD) with one
group of rules per sandbox, tagged ``ae-<sandbox_id>`` for removal:

* replies on connections the host opened (the host talks to envd) are accepted;
* anything else the sandbox sends to the host itself, or to another sandbox, is dropped;
* with ``allow_internet_access`` the rest is forwarded and masqueraded (nat chain ``AGENTENV``
  in POSTROUTING), without it every packet the sandbox tries to send onward is dropped;
* nothing may open a forwarded connection into a sandbox.

Snapshot/restore: a checkpointed gVisor netstack keeps the address it was saved with. Two ways
to live with that were on the table: (a) one fixed address inside every netns, each sandbox
reached through its own veth and a per-netns NAT, so a restored image fits any slot; (b) keep
per-slot addresses and re-address the restored netstack. gVisor's netstack owns the sandbox end
of the veth (the netns kernel never sees its packets), so (a) would need a second veth pair and
DNAT inside every netns, one more hop on every envd request. The checkpoint code takes (b): a
resume keeps its slot, a restore into a new sandbox (fork) gets a new slot and re-addresses the
netstack with ``runsc exec ip`` (see ``agentenv/runtime/gvisor/checkpoint.py``). QEMU guests
use a fixed guest address behind a tap instead (their own choice, inside the same netns).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentenv.config import Settings
from agentenv.runtime.base import RuntimeError_

NETNS_PREFIX = "ae-"
HOST_IF_PREFIX = "aeh"
SANDBOX_IF_PREFIX = "aes"
CHAIN = "AGENTENV"
NETNS_DIR = Path("/var/run/netns")
#: Serialises creation of the shared chains and hooks among all agentenv processes on the host.
GLOBAL_LOCK = Path("/run/agentenv-net.lock")


class NetworkError(RuntimeError_):
    pass


@dataclass(frozen=True)
class SandboxNetwork:
    sandbox_id: str
    netns: str
    slot: int
    host_if: str
    sandbox_if: str
    host_ip: str
    sandbox_ip: str
    prefixlen: int = 30
    allow_internet_access: bool = True

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SandboxNetwork:
        return cls(**state)


def netns_name(sandbox_id: str) -> str:
    return NETNS_PREFIX + sandbox_id


def _net_dir(settings: Settings) -> Path:
    d = settings.data_dir / "net"
    d.mkdir(parents=True, exist_ok=True)
    return d


def slot_addresses(settings: Settings, slot: int) -> tuple[str, str]:
    """(host_ip, sandbox_ip) of ``slot``."""
    net = ipaddress.ip_network(settings.sandbox_subnet)
    if net.prefixlen > 30:
        raise NetworkError(f"sandbox subnet {net} is too small for /30 links")
    base = int(net.network_address) + 4 * slot
    if base + 3 > int(net.broadcast_address):
        raise NetworkError(f"slot {slot} is outside sandbox subnet {net}")
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


def slot_count(settings: Settings) -> int:
    return int(ipaddress.ip_network(settings.sandbox_subnet).num_addresses // 4)


# -- slots --------------------------------------------------------------------------------------


def _claim_slot(settings: Settings, sandbox_id: str, skip: set[int]) -> int:
    """Claim the next free slot after the one claimed last (round robin, not lowest-free).

    Handing a just-freed address straight to the next sandbox would let clients' pooled
    keep-alive connections (the SDK's, the proxy's) and conntrack entries of the dead sandbox
    hit the new one; cycling through the subnet keeps addresses unused for a long while."""
    net_dir = _net_dir(settings)
    count = slot_count(settings)
    cursor = net_dir / "last-slot"
    try:
        last = int(cursor.read_text())
    except (OSError, ValueError):
        last = 0
    # Slot 0 holds the subnet's network address; slots run 1..count-1 so addresses read naturally.
    for step in range(1, count):
        slot = (last + step - 1) % (count - 1) + 1
        if slot in skip or Path(f"/sys/class/net/{HOST_IF_PREFIX}{slot}").exists():
            continue
        try:
            fd = os.open(net_dir / f"slot-{slot}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(sandbox_id + "\n")
        tmp = net_dir / f".last-slot.{os.getpid()}"
        tmp.write_text(str(slot))
        os.replace(tmp, cursor)
        return slot
    raise NetworkError("no free network slot left in the sandbox subnet", code=503)


def _release_slot(settings: Settings, slot: int) -> None:
    (_net_dir(settings) / f"slot-{slot}").unlink(missing_ok=True)


def claimed_slots(settings: Settings) -> dict[str, int]:
    """sandbox_id -> slot of every slot this data directory has claimed."""
    found = {}
    for path in _net_dir(settings).glob("slot-*"):
        with contextlib.suppress(OSError, ValueError):
            found[path.read_text().strip()] = int(path.name.removeprefix("slot-"))
    return found


# -- commands -----------------------------------------------------------------------------------


async def _run(*cmd: str, check: bool = True) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    text = out.decode(errors="replace").strip()
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {text}")
    return proc.returncode or 0, text


async def _iptables(*args: str, table: str = "filter", check: bool = True) -> tuple[int, str]:
    return await _run("iptables", "-w", "10", "-t", table, *args, check=check)


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    with open(GLOBAL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


async def ensure_chains() -> None:
    """Create the AGENTENV chains and their hooks once (idempotent, safe across processes)."""
    # In a thread: the flock may wait for another process, and must not block the event loop
    # (concurrent creates in this process would deadlock on it).
    await asyncio.to_thread(_ensure_chains_locked)


def _ensure_chains_locked() -> None:
    hooks: list[tuple[str, str, tuple[str, ...]]] = [
        ("filter", "INPUT", ("-i", HOST_IF_PREFIX + "+", "-j", CHAIN)),
        ("filter", "FORWARD", ("-j", CHAIN)),
        ("nat", "POSTROUTING", ("-j", CHAIN)),
    ]

    def iptables(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True)

    with _global_lock():
        for table in ("filter", "nat"):
            proc = iptables("-t", table, "-N", CHAIN)
            if proc.returncode != 0 and "exists" not in proc.stderr:
                raise NetworkError(f"cannot create iptables chain {CHAIN} in {table}: {proc.stderr}")
        for table, hook, rule in hooks:
            if iptables("-t", table, "-C", hook, *rule).returncode != 0:
                proc = iptables("-t", table, "-I", hook, "1", *rule)
                if proc.returncode != 0:
                    raise NetworkError(f"cannot hook {CHAIN} into {table} {hook}: {proc.stderr}")


def _filter_rules(net: SandboxNetwork, subnet: str) -> list[list[str]]:
    tag = ["-m", "comment", "--comment", net.netns]
    hif = net.host_if
    rules = [
        ["-i", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-i", hif, "-m", "addrtype", "--dst-type", "LOCAL", "-j", "DROP"],
        ["-i", hif, "-d", subnet, "-j", "DROP"],
        ["-i", hif, "-j", "ACCEPT" if net.allow_internet_access else "DROP"],
        ["-o", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-o", hif, "-j", "DROP"],
    ]
    return [[*r[:-2], *tag, *r[-2:]] for r in rules]


def _enable_ip_forward() -> None:
    path = Path("/proc/sys/net/ipv4/ip_forward")
    if path.read_text().strip() != "1":
        path.write_text("1\n")


# -- lifecycle ----------------------------------------------------------------------------------


async def setup_network(
    settings: Settings, sandbox_id: str, *, allow_internet_access: bool
) -> SandboxNetwork:
    """Create the netns, link and filter rules of ``sandbox_id``; on failure nothing is left."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,60}", sandbox_id):
        raise NetworkError(f"invalid sandbox id {sandbox_id!r}", code=400)
    await ensure_chains()
    netns = netns_name(sandbox_id)
    await _run("ip", "netns", "add", netns)
    tried: set[int] = set()
    net: SandboxNetwork | None = None
    try:
        while net is None:
            slot = _claim_slot(settings, sandbox_id, tried)
            tried.add(slot)
            host_ip, sandbox_ip = slot_addresses(settings, slot)
            candidate = SandboxNetwork(
                sandbox_id=sandbox_id, netns=netns, slot=slot, host_if=f"{HOST_IF_PREFIX}{slot}",
                sandbox_if=f"{SANDBOX_IF_PREFIX}{slot}", host_ip=host_ip, sandbox_ip=sandbox_ip,
                allow_internet_access=allow_internet_access,
            )
            code, out = await _run(
                "ip", "link", "add", candidate.host_if, "type", "veth",
                "peer", "name", candidate.sandbox_if, "netns", netns, check=False,
            )
            if code == 0:
                net = candidate
            elif "exists" in out:  # another data directory took the interface name first
                _release_slot(settings, slot)
            else:
                _release_slot(settings, slot)
                raise NetworkError(f"cannot create veth {candidate.host_if}: {out}")
        await _configure(net, settings)
    except BaseException:
        await teardown_network(settings, sandbox_id, net)
        raise
    return net


async def _configure(net: SandboxNetwork, settings: Settings) -> None:
    plen = str(net.prefixlen)
    await _run("ip", "addr", "add", f"{net.host_ip}/{plen}", "dev", net.host_if)
    await _run("ip", "link", "set", net.host_if, "up")
    ns = ("ip", "-n", net.netns)
    await _run(*ns, "addr", "add", f"{net.sandbox_ip}/{plen}", "dev", net.sandbox_if)
    await _run(*ns, "link", "set", net.sandbox_if, "up")
    await _run(*ns, "link", "set", "lo", "up")
    await _run(*ns, "route", "add", "default", "via", net.host_ip)
    for rule in _filter_rules(net, settings.sandbox_subnet):
        await _iptables("-A", CHAIN, *rule)
    if net.allow_internet_access:
        _enable_ip_forward()
        await _iptables(
            "-A", CHAIN, "-s", f"{net.sandbox_ip}/32", "!", "-d", settings.sandbox_subnet,
            "-m", "comment", "--comment", net.netns, "-j", "MASQUERADE", table="nat",
        )


async def _delete_tagged_rules(tag: str) -> None:
    for table in ("filter", "nat"):
        code, out = await _iptables("-S", CHAIN, table=table, check=False)
        if code != 0:
            continue
        for line in out.splitlines():
            if line.startswith(f"-A {CHAIN} ") and f"--comment {tag} " in line + " ":
                args = line.split()[2:]
                await _iptables("-D", CHAIN, *[a.strip('"') for a in args], table=table, check=False)


async def teardown_network(settings: Settings, sandbox_id: str, net: SandboxNetwork | None = None) -> None:
    """Remove the netns, link, rules and slot of ``sandbox_id``. Idempotent; works without
    ``net`` (state lost in a crash) by finding the slot from this data directory's claims."""
    netns = netns_name(sandbox_id)
    slot = net.slot if net else claimed_slots(settings).get(sandbox_id)
    await _delete_tagged_rules(netns)
    if _netns_exists(netns):
        await _run("ip", "netns", "del", netns, check=False)
    if slot is not None:
        host_if = f"{HOST_IF_PREFIX}{slot}"
        # Deleting the netns destroys the veth pair, unless a process still holds the netns.
        if _link_exists(host_if) and _claimed_by(settings, slot) == sandbox_id:
            await _run("ip", "link", "del", host_if, check=False)
        if _claimed_by(settings, slot) == sandbox_id:
            _release_slot(settings, slot)


def _netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _claimed_by(settings: Settings, slot: int) -> str | None:
    try:
        return (_net_dir(settings) / f"slot-{slot}").read_text().strip()
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise


def list_netns(prefix: str = NETNS_PREFIX) -> list[str]:
    """Sandbox ids of every network namespace on the host named ``<prefix><sandbox_id>``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name[len(prefix):] for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def list_orphans(settings: Settings, keep: set[str]) -> list[str]:
    """Sandbox ids with network resources of this data directory that are not in ``keep``.

    Only slots claimed under ``settings.data_dir`` count: an ``ae-`` netns without such a claim
    may belong to another agentenv instance (or test run) on the same host."""
    return sorted(sid for sid in claimed_slots(settings) if sid not in keep)


async def cleanup_orphans(settings: Settings, keep: set[str]) -> list[str]:
    orphans = list_orphans(settings, keep)
    for sandbox_id in orphans:
        await teardown_network(settings, sandbox_id)
    return orphans
