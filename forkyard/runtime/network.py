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
data directory on the same machine) and retried when the veth's creation loses a race.

Filtering, in chain ``FORKYARD`` (jumped to from INPUT for ``aeh+`` and from FORWARD) with one
group of rules per sandbox, tagged ``ae-<sandbox_id>`` for removal:

* replies on connections the host opened (the host talks to envd) are accepted;
* anything else the sandbox sends to the host itself, or to another sandbox, is dropped;
* the rest goes to the sandbox's own egress chain ``AEO-aeh<slot>`` (its policy, below) and,
  when accepted there, is forwarded and masqueraded (nat chain ``FORKYARD`` in POSTROUTING);
* nothing may open a forwarded connection into a sandbox.

The egress chain (E2B's ``network.allowOut``/``denyOut`` and ``allow_internet_access``, in this
order; the first match decides):

1. ``allow_out`` networks: accepted (allow beats every deny, as in E2B);
2. the default denials: link-local 169.254.0.0/16 (cloud metadata services), RFC 1918, CGNAT
   100.64.0.0/10 and the networks of the node's own interfaces (its LAN neighbours): dropped;
3. ``deny_out`` networks: dropped;
4. everything else: accepted with internet access, dropped without (``allow_internet_access=False``
   is ``deny_out=["0.0.0.0/0"]``, so ``allow_out`` still opens its exceptions).

Domain rules (``allow_out`` names, :mod:`forkyard.runtime.egress_proxy`): a nat chain
``AEP-aeh<slot>`` (from PREROUTING via ``FORKYARD-PRE``) redirects the sandbox's new TCP
connections to ports 80 and 443 that no ``allow_out`` network covers to the node's egress proxy,
which matches their TLS SNI or HTTP Host; the filter chain lets a sandbox into the host only for
those redirected connections. The resolvers (port 53) are opened in the egress chain, after
``allow_out``. The proxy learns the policy from ``{data_dir}/net/domains-<slot>.json``.

E2B drops private ranges even when ``allow_out`` names them; here an explicit ``allow_out`` opens
them (a sandbox may be meant to reach a private service), which is our extension. The host itself
and other sandboxes stay closed whatever the policy says (they are dropped before the chain).
The chain is enforced on the host side of the veth, not inside the sandbox's netns: gVisor's
netstack writes its packets straight onto the netns end of the veth (a packet socket), past
the netns kernel's netfilter, so rules there would never see them; every runtime's packets cross
the host side. A policy change replaces the chain's rules in one ``iptables-restore`` commit
(declaring an existing chain flushes it in the same transaction), so no packet sees a half-made
policy; connections already open stay open (replies match rule one of ``FORKYARD``), as in E2B.

Cost: creates, restores and kills run this for every sandbox, often many at once (a fork of
16), so no step starts a process it can do without: the netns, the veth pair, addresses, links
and routes are made and removed from this process (netlink through pyroute2, the namespace's own
system calls: :mod:`forkyard.runtime.netlink`), and the rules of a setup or teardown are one
``iptables-restore --noflush`` shared by the concurrent setups and teardowns of this process
(``_RestoreQueue``).

Snapshot/restore: a checkpointed gVisor sandbox was addressed by its slot. Two ways to live with
that were on the table: (a) one fixed address inside every netns, each sandbox reached through
its own veth and a per-netns NAT, so a restored image fits any slot; (b) keep per-slot addresses
and give a restored sandbox the address of its own slot. gVisor's netstack owns the sandbox end
of the veth (the netns kernel never sees its packets), so (a) would need a second veth pair and
DNAT inside every netns, one more hop on every envd request. The gVisor runtime takes (b): a
resume keeps its slot, a restore into a new sandbox (fork child, create from a snapshot) gets a
new slot, and :func:`readdress` puts that slot's address on the link before ``runsc restore``
builds the restored netstack from it (see ``forkyard/runtime/gvisor/checkpoint.py``). QEMU guests
use a fixed guest address behind a tap instead (their own choice, inside the same netns).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import re
import socket
import subprocess
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import psutil

from forkyard.config import Settings
from forkyard.errors import Failed, Invalid, Unavailable
from forkyard.runtime import egress_proxy, netlink
from forkyard.storage.atomic import exclusive
from forkyard.types import NETNS_DIR, EgressPolicy, SandboxNetwork

log = logging.getLogger(__name__)
T = TypeVar("T")

NETNS_PREFIX = "ae-"
HOST_IF_PREFIX = "aeh"
SANDBOX_IF_PREFIX = "aes"
CHAIN = "FORKYARD"
#: nat chain hooked into PREROUTING for traffic from sandboxes: the jumps to their redirects.
PRE_CHAIN = "FORKYARD-PRE"
#: Per-sandbox egress chains are named by the host interface (unique on the host, unlike slots).
EGRESS_CHAIN_PREFIX = "AEO-"
#: Per-sandbox nat chains sending domain-checked ports (80, 443) to the egress proxy.
REDIRECT_CHAIN_PREFIX = "AEP-"
#: Ports whose connections carry a name the egress proxy can check (HTTP Host, TLS SNI), as E2B.
DOMAIN_PORTS = (egress_proxy.HTTP_PORT, egress_proxy.TLS_PORT)
#: What a sandbox with internet access may not reach unless its ``allow_out`` names it.
DEFAULT_DENIED = ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
#: Serialises creation of the shared chains and hooks among all forkyard processes on the host.
GLOBAL_LOCK = Path("/run/forkyard-net.lock")


class NetworkError(Failed):
    """A network command failed, or the sandbox subnet cannot hold the link asked for."""


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


# -- egress policy (parsed in runtime/egress_policy.py) -------------------------------------------


def node_networks() -> list[str]:
    """The IPv4 networks of the node's own interfaces (its LAN and whatever else it sits in),
    except loopback and the sandboxes' links: denied by default like the private ranges."""
    found: dict[str, None] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if name == "lo" or name.startswith(HOST_IF_PREFIX):
            continue
        for addr in addrs:
            if addr.family != socket.AF_INET or not addr.netmask:
                continue
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(f"{addr.address}/{addr.netmask}", strict=False)
                if net.prefixlen > 0 and not net.is_loopback:
                    found[str(net)] = None
    return list(found)


def egress_chain(net: SandboxNetwork) -> str:
    return EGRESS_CHAIN_PREFIX + net.host_if


def egress_rules(allow_internet_access: bool, policy: EgressPolicy | None) -> list[list[str]]:
    """The rules of a sandbox's egress chain, in order (see the module docstring)."""
    policy = policy or EgressPolicy()
    denied = dict.fromkeys([*DEFAULT_DENIED, *node_networks(), *policy.deny_out])
    rules = [["-d", cidr, "-j", "ACCEPT"] for cidr in policy.allow_out]
    rules += [
        ["-d", f"{server}/32", "-p", proto, "--dport", "53", "-j", "ACCEPT"]
        for server in policy.resolvers
        for proto in ("udp", "tcp")
    ]
    rules += [["-d", cidr, "-j", "DROP"] for cidr in denied]
    rules.append(["-j", "ACCEPT" if allow_internet_access else "DROP"])
    return rules


def _egress_lines(net: SandboxNetwork, allow_internet_access: bool, policy: EgressPolicy | None) -> list[str]:
    """Declare (create, or flush when it exists) and fill the egress chain: one transaction."""
    chain = egress_chain(net)
    return [f":{chain} - [0:0]"] + [
        " ".join(["-A", chain, *rule]) for rule in egress_rules(allow_internet_access, policy)
    ]


def redirect_chain(net: SandboxNetwork) -> str:
    return REDIRECT_CHAIN_PREFIX + net.host_if


def redirect_rules(subnet: str, policy: EgressPolicy | None, proxy_port: int) -> list[list[str]]:
    """The rules of a sandbox's nat redirect chain: with domain rules, new TCP connections to
    ports 80 and 443 that its egress chain would drop go to the egress proxy (the host, other
    sandboxes and ``allow_out`` are left alone: the filter decides those). Domain rules come
    with everything else closed (``egress_policy.parse_egress``), so "would drop" is "not
    allow_out"."""
    if policy is None or not policy.allow_domains:
        return []
    rules = [["-m", "addrtype", "--dst-type", "LOCAL", "-j", "RETURN"], ["-d", subnet, "-j", "RETURN"]]
    rules += [["-d", cidr, "-j", "RETURN"] for cidr in policy.allow_out]
    ports = ",".join(str(p) for p in DOMAIN_PORTS)
    rules.append(
        ["-p", "tcp", "-m", "multiport", "--dports", ports, "-j", "REDIRECT", "--to-ports", str(proxy_port)]
    )
    return rules


def _redirect_lines(
    net: SandboxNetwork, subnet: str, policy: EgressPolicy | None, proxy_port: int
) -> list[str]:
    chain = redirect_chain(net)
    return [f":{chain} - [0:0]"] + [
        " ".join(["-A", chain, *r]) for r in redirect_rules(subnet, policy, proxy_port)
    ]


async def _proxy_port(settings: Settings, policy: EgressPolicy | None) -> int:
    """The egress proxy's port, started when ``policy`` needs it (0: it does not)."""
    if policy is None or not policy.allow_domains:
        return 0
    return (await egress_proxy.ensure_started(settings)).port


def _publish_domains(settings: Settings, net: SandboxNetwork, policy: EgressPolicy | None) -> None:
    """Tell the egress proxy (through the slot's policy file) what ``net``'s sandbox may reach."""
    if policy is None or not policy.allow_domains:
        egress_proxy.write_policy(settings, net.slot, None)
        return
    denied = [*DEFAULT_DENIED, *node_networks(), settings.sandbox_subnet]
    egress_proxy.write_policy(
        settings,
        net.slot,
        egress_proxy.DomainPolicy(
            sandbox_id=net.sandbox_id,
            sandbox_ip=net.sandbox_ip,
            domains=policy.allow_domains,
            allowed=policy.allow_out,
            denied=tuple(dict.fromkeys(denied)),
        ),
    )


async def resume_egress_proxy(settings: Settings) -> None:
    """Start the egress proxy at server start when sandboxes that outlived the last run have
    domain rules (their redirects point at it)."""
    if egress_proxy.has_policies(settings):
        await egress_proxy.ensure_started(settings)


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
    raise Unavailable("no free network slot left in the sandbox subnet")


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
#
# Every command is a process start (a few ms each on a small host) and every iptables commit
# waits for the kernel (with nf_tables a commit that deletes rules waits out an RCU grace period,
# and concurrent commits race: the loser refetches the ruleset and tries again), hence batches.


async def run(*cmd: str, check: bool = True, input: str | None = None) -> tuple[int, str]:
    """Run ``cmd`` (``input`` on its stdin): (exit code, stdout+stderr). With ``check`` a non-zero
    exit raises :class:`NetworkError`. Cancelling the caller kills the command first."""
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE if input is not None else None,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await proc.communicate(input.encode() if input is not None else None)
    except BaseException:
        # Cancelled: stop the command before the caller cleans up, or a batch still running
        # behind its back could add what the cleanup has already looked for.
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace").strip()
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {text}")
    return proc.returncode or 0, text


#: iptables-restore input: table -> lines (``-A``/``-D``/``-C`` commands), one commit per table.
Script = dict[str, list[str]]
TABLES = ("filter", "nat")


def _restore_input(script: Script) -> str:
    return "".join(
        f"*{table}\n" + "".join(f"{line}\n" for line in script[table]) + "COMMIT\n"
        for table in TABLES
        if script.get(table)
    )


async def _iptables_restore(script: Script, *, check: bool = True) -> tuple[int, str]:
    """Apply ``script`` on top of the current rules: each table commits as a whole or not at all
    (but one table may commit and the next fail)."""
    return await run("iptables-restore", "--noflush", "-w", "10", check=check, input=_restore_input(script))


class _RestoreQueue:
    """Group commit of the rule changes of concurrent setups and teardowns in this process.

    Changes requested while one ``iptables-restore`` runs go together into the next one: 16
    concurrent teardowns cost one restore instead of 16 (setups, whose requests arrive spread
    out, a few), and the restores no longer race each other (with nf_tables every commit that
    loses the race refetches the ruleset and tries again). A batch fails as a whole (one table may
    have committed): every request in it is then told it failed and takes its own way back (see
    ``_add_rules`` and ``_delete_tagged_rules``), all of which cope with half-applied changes.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Script, asyncio.Future[bool]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def apply(self, script: Script) -> bool:
        """Whether ``script`` was applied (False: maybe partly, see the class docstring)."""
        entry = (script, asyncio.get_running_loop().create_future())
        self._pending.append(entry)
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        try:
            return await asyncio.shield(entry[1])
        except asyncio.CancelledError:
            if any(e is entry for e in self._pending):  # not started: drop it
                self._pending = [e for e in self._pending if e is not entry]
            elif not entry[1].done():
                # Running: wait, so that the caller's cleanup sees what it changed. How it went
                # does not matter any more: the caller is cancelled and cleans up either way.
                with contextlib.suppress(Exception):
                    await entry[1]
            raise

    async def _drain(self) -> None:
        batch: list[tuple[Script, asyncio.Future[bool]]] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                merged: Script = {table: [] for table in TABLES}
                for script, _ in batch:
                    for table, lines in script.items():
                        merged[table] += [
                            line for line in lines if not (line.startswith("-C ") and line in merged[table])
                        ]
                try:
                    code, _ = await _iptables_restore(merged, check=False)
                except Exception as exc:
                    for _, future in batch:
                        future.set_exception(exc)
                else:
                    for _, future in batch:
                        future.set_result(code == 0)
                batch = []
        finally:
            for _, future in batch + self._pending:
                future.cancel()
            self._pending = []
            self._drainer = None


_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _RestoreQueue] = weakref.WeakKeyDictionary()


def _restore_queue() -> _RestoreQueue:
    loop = asyncio.get_running_loop()
    queue = _queues.get(loop)
    if queue is None:
        queue = _queues[loop] = _RestoreQueue()
    return queue


#: (table, hook chain, rule) of the jumps into the FORKYARD chains.
HOOKS: list[tuple[str, str, tuple[str, ...]]] = [
    ("filter", "INPUT", ("-i", HOST_IF_PREFIX + "+", "-j", CHAIN)),
    ("filter", "FORWARD", ("-j", CHAIN)),
    ("nat", "POSTROUTING", ("-j", CHAIN)),
    ("nat", "PREROUTING", ("-i", HOST_IF_PREFIX + "+", "-j", PRE_CHAIN)),
]
#: (table, chain) of the shared chains the hooks jump to.
SHARED_CHAINS = [("filter", CHAIN), ("nat", CHAIN), ("nat", PRE_CHAIN)]


async def ensure_chains() -> None:
    """Create the FORKYARD chains and their hooks once (idempotent, safe across processes)."""
    # In a thread: the flock may wait for another process, and must not block the event loop
    # (concurrent creates in this process would deadlock on it).
    await asyncio.to_thread(_ensure_chains_locked)


def _ensure_chains_locked() -> None:
    def iptables(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True)

    with exclusive(GLOBAL_LOCK):
        for table, chain in SHARED_CHAINS:
            proc = iptables("-t", table, "-N", chain)
            if proc.returncode != 0 and "exists" not in proc.stderr:
                raise NetworkError(f"cannot create iptables chain {chain} in {table}: {proc.stderr}")
        for table, hook, rule in HOOKS:
            if iptables("-t", table, "-C", hook, *rule).returncode != 0:
                proc = iptables("-t", table, "-I", hook, "1", *rule)
                if proc.returncode != 0:
                    raise NetworkError(f"cannot hook {CHAIN} into {table} {hook}: {proc.stderr}")


def _filter_rules(net: SandboxNetwork, subnet: str) -> list[list[str]]:
    tag = ["-m", "comment", "--comment", net.netns]
    hif = net.host_if
    # What the redirect chain sent to the egress proxy (a DNAT to a local address, from port 80
    # or 443) is the only way in to the host; a direct connection to the proxy's port is not.
    accept = ["-j", "ACCEPT"]
    to_proxy = [
        ["-i", hif, "-p", "tcp", "-m", "conntrack", "--ctstate", "DNAT", "--ctorigdstport", str(p), *accept]
        for p in DOMAIN_PORTS
    ]
    rules = [
        ["-i", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        *to_proxy,
        ["-i", hif, "-m", "addrtype", "--dst-type", "LOCAL", "-j", "DROP"],
        ["-i", hif, "-d", subnet, "-j", "DROP"],
        _jump_rule(net),
        ["-o", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-o", hif, "-j", "DROP"],
    ]
    return [[*r[:-2], *tag, *r[-2:]] for r in rules]


def _jump_rule(net: SandboxNetwork) -> list[str]:
    return ["-i", net.host_if, "-j", egress_chain(net)]


def _pre_rules(net: SandboxNetwork) -> list[list[str]]:
    """The rule of chain ``FORKYARD-PRE`` (nat, PREROUTING) that ``net`` gets."""
    tag = ["-m", "comment", "--comment", net.netns]
    return [["-i", net.host_if, "-p", "tcp", *tag, "-j", redirect_chain(net)]]


def _nat_rules(net: SandboxNetwork, subnet: str) -> list[list[str]]:
    # Whatever the egress chain accepts leaves with the host's address; the chain filters.
    return [
        [
            "-s",
            f"{net.sandbox_ip}/32",
            "!",
            "-d",
            subnet,
            "-m",
            "comment",
            "--comment",
            net.netns,
            "-j",
            "MASQUERADE",
        ]
    ]


def sandbox_rules(net: SandboxNetwork, subnet: str) -> dict[str, list[list[str]]]:
    """table -> the rules (in chain ``FORKYARD``, in order) that ``net`` gets."""
    return {"filter": _filter_rules(net, subnet), "nat": _nat_rules(net, subnet)}


def _rule_script(command: str, net: SandboxNetwork, subnet: str) -> Script:
    script = {
        table: [" ".join([command, CHAIN, *rule]) for rule in rules]
        for table, rules in sandbox_rules(net, subnet).items()
    }
    script["nat"] += [" ".join([command, PRE_CHAIN, *rule]) for rule in _pre_rules(net)]
    if command == "-D":  # the jumps are gone: the per-sandbox chains can go (emptied first)
        script["filter"] += [f"-F {egress_chain(net)}", f"-X {egress_chain(net)}"]
        script["nat"] += [f"-F {redirect_chain(net)}", f"-X {redirect_chain(net)}"]
    return script


def _add_script(net: SandboxNetwork, subnet: str, egress: list[str], redirect: list[str]) -> Script:
    """Append ``net``'s rules after checking the hooks: a table's commit fails as a whole when a
    hook or chain is missing (flushed by someone since they were made, or never made). The
    egress and redirect chains (``egress``, ``redirect``: their lines) are made first: the jumps
    into them need them."""
    script = _rule_script("-A", net, subnet)
    script["filter"][:0] = egress
    script["nat"][:0] = redirect
    for table, hook, rule in reversed(HOOKS):
        script[table].insert(0, " ".join(["-C", hook, *rule]))
    return script


async def _add_rules(net: SandboxNetwork, settings: Settings, egress: EgressPolicy | None) -> None:
    _enable_ip_forward()
    lines = _egress_lines(net, net.allow_internet_access, egress)
    port = await _proxy_port(settings, egress)
    _publish_domains(settings, net, egress)
    redirect = _redirect_lines(net, settings.sandbox_subnet, egress, port)
    script = _add_script(net, settings.sandbox_subnet, lines, redirect)
    if not await _restore_queue().apply(script):
        # Commits are per table, so one may have gone through: remove it before trying again.
        await _delete_tagged_rules(net.netns)
        await ensure_chains()
        await _iptables_restore(script)


def _tagged(line: str, tag: str) -> bool:
    line += " "
    return f"--comment {tag} " in line or f'--comment "{tag}" ' in line


async def _delete_tagged_rules(
    tag: str, net: SandboxNetwork | None = None, subnet: str = "", chains: frozenset[str] = frozenset()
) -> None:
    """Delete every rule tagged ``tag`` from the FORKYARD chains, and the egress chains they jump
    to (plus ``chains``, when they exist).

    With ``net`` its rules are deleted as they were made (no lookup); when that fails (some are
    gone, or were made with other settings) and without ``net`` they are looked up."""
    if net is not None and await _restore_queue().apply(_rule_script("-D", net, subnet)):
        return
    for _ in range(3):  # a rule deleted meanwhile (a concurrent teardown) fails the whole commit
        code, out = await run("iptables-save", check=False)
        if code != 0:
            return
        deletes = _tagged_deletes(out, tag, {egress_chain(net)} | chains if net else set(chains))
        if not any(deletes.values()) or (await _iptables_restore(deletes, check=False))[0] == 0:
            return


def _tagged_deletes(saved: str, tag: str, chains: set[str]) -> Script:
    """From ``iptables-save`` output: deletes of the FORKYARD rules tagged ``tag``, then the
    flush and removal of the egress chains they jump to (and of ``chains``) that exist."""
    deletes: Script = {table: [] for table in TABLES}
    existing: set[tuple[str, str]] = set()
    own = {"filter": EGRESS_CHAIN_PREFIX, "nat": REDIRECT_CHAIN_PREFIX}
    chains |= {REDIRECT_CHAIN_PREFIX + c.removeprefix(EGRESS_CHAIN_PREFIX) for c in chains}
    table = ""
    for line in saved.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif table in own and line.startswith(":" + own[table]):
            existing.add((table, line[1:].split()[0]))
        elif (
            table in deletes and line.startswith((f"-A {CHAIN} ", f"-A {PRE_CHAIN} ")) and _tagged(line, tag)
        ):
            deletes[table].append("-D" + line[2:])
            found = re.search(rf"-j ((?:{EGRESS_CHAIN_PREFIX}|{REDIRECT_CHAIN_PREFIX})\S+)", line)
            if found:
                chains.add(found.group(1))
    for table, chain in sorted(existing):
        if chain in chains:
            deletes[table] += [f"-F {chain}", f"-X {chain}"]
    return deletes


async def update_egress(
    settings: Settings, net: SandboxNetwork, *, allow_internet_access: bool, egress: EgressPolicy | None
) -> None:
    """Replace a live sandbox's egress policy: one commit, no moment without a policy. A
    sandbox whose rules predate egress chains (made by an older forkyard) gets its rules
    rebuilt instead."""
    lines = _egress_lines(net, allow_internet_access, egress)
    port = await _proxy_port(settings, egress)
    redirect = _redirect_lines(net, settings.sandbox_subnet, egress, port)
    tag = ["-m", "comment", "--comment", net.netns]
    jump = " ".join(["-C", CHAIN, *_jump_rule(net)[:-2], *tag, *_jump_rule(net)[-2:]])
    pre_jump = " ".join(["-C", PRE_CHAIN, *_pre_rules(net)[0]])
    # A policy gaining domains is published before its redirects, one losing them after.
    if egress is not None and egress.allow_domains:
        _publish_domains(settings, net, egress)
    if not await _restore_queue().apply({"filter": [jump, *lines], "nat": [pre_jump, *redirect]}):
        await _delete_tagged_rules(net.netns)
        await ensure_chains()
        await _iptables_restore(_add_script(net, settings.sandbox_subnet, lines, redirect))
    _publish_domains(settings, net, egress)


def _enable_ip_forward() -> None:
    path = Path("/proc/sys/net/ipv4/ip_forward")
    if path.read_text().strip() != "1":
        path.write_text("1\n")


# -- lifecycle ----------------------------------------------------------------------------------


class _NetnsExists(NetworkError):
    """Making the netns failed: a namespace of that name exists and is not ours to remove."""


async def setup_network(
    settings: Settings, sandbox_id: str, *, allow_internet_access: bool, egress: EgressPolicy | None = None
) -> SandboxNetwork:
    """Create the netns, link and filter rules of ``sandbox_id``; on failure nothing is left.

    One process: ``iptables-restore`` (shared with concurrent setups and teardowns); the rest is
    netlink from this process."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,60}", sandbox_id):
        raise Invalid(f"invalid sandbox id {sandbox_id!r}")
    netns = netns_name(sandbox_id)
    tried: set[int] = set()
    net: SandboxNetwork | None = None
    netns_added = rules_tried = False
    try:
        while net is None:
            slot = _claim_slot(settings, sandbox_id, tried)
            tried.add(slot)
            host_ip, sandbox_ip = slot_addresses(settings, slot)
            candidate = SandboxNetwork(
                sandbox_id=sandbox_id,
                netns=netns,
                slot=slot,
                host_if=f"{HOST_IF_PREFIX}{slot}",
                sandbox_if=f"{SANDBOX_IF_PREFIX}{slot}",
                host_ip=host_ip,
                sandbox_ip=sandbox_ip,
                allow_internet_access=allow_internet_access,
            )
            net = await _create_link(settings, candidate, add_netns=not netns_added)
            netns_added = True
        await _configure_netns(net)
        rules_tried = True
        await _add_rules(net, settings, egress)
    except _NetnsExists:
        raise
    except BaseException:
        # Rules that failed to go in may have gone in partly: look them up rather than guess.
        await _teardown(settings, sandbox_id, net, rules="lookup" if rules_tried else "none")
        raise
    return net


async def _off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` (blocking netlink, :mod:`forkyard.runtime.netlink`) in a worker thread. A cancelled
    caller still waits for it to end: its cleanup must see what the call made."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await work
        raise


async def _create_link(settings: Settings, net: SandboxNetwork, *, add_netns: bool) -> SandboxNetwork | None:
    """The netns (unless it is there already), the veth pair and the host side's address; None
    when another data directory took the interface name first (the slot is released)."""
    if add_netns:
        try:
            await _off_loop(netlink.create_netns, net.netns)
        except FileExistsError as exc:
            _release_slot(settings, net.slot)
            raise _NetnsExists(f"netns add {net.netns}: the network namespace exists") from exc
        except Exception as exc:
            _release_slot(settings, net.slot)
            raise NetworkError(f"creating network namespace {net.netns} failed: {exc}") from exc
    try:
        await _off_loop(netlink.add_veth, net.host_if, net.sandbox_if, net.netns, net.host_ip, net.prefixlen)
    except netlink.LinkExists:
        _release_slot(settings, net.slot)
        return None
    except Exception as exc:  # what was made is the caller's to tear down (the slot names it)
        raise NetworkError(f"creating link {net.host_if} of {net.netns} failed: {exc}") from exc
    return net


async def _address_sandbox_side(net: SandboxNetwork, *, replace: bool) -> None:
    try:
        await _off_loop(
            netlink.address_sandbox_side,
            net.netns,
            net.sandbox_if,
            net.sandbox_ip,
            net.prefixlen,
            net.host_ip,
            replace=replace,
        )
    except Exception as exc:
        raise NetworkError(f"addressing {net.sandbox_if} in {net.netns} failed: {exc}") from exc


async def _configure_netns(net: SandboxNetwork) -> None:
    await _address_sandbox_side(net, replace=False)


async def readdress(net: SandboxNetwork) -> None:
    """Put the sandbox address and default route (back) on the netns side of the veth, replacing
    what is there (a resume runs this before ``runsc restore``)."""
    await _address_sandbox_side(net, replace=True)


async def teardown_network(settings: Settings, sandbox_id: str, net: SandboxNetwork | None = None) -> None:
    """Remove the netns, link, rules and slot of ``sandbox_id``. Idempotent; works without
    ``net`` (state lost in a crash) by finding the slot from this data directory's claims.

    One process: ``iptables-restore`` (shared with concurrent setups and teardowns; without
    ``net``, or when ``net``'s rules are not all there, ``iptables-save`` first); the link and
    netns go by netlink and system calls."""
    # A second teardown finds the slot released: its rules are gone (deleted before the release)
    # or were not all deleted, so look them up rather than fail a shared commit with them.
    known = net is not None and _claimed_by(settings, net.slot) == sandbox_id
    await _teardown(settings, sandbox_id, net, rules="known" if known else "lookup")


async def _teardown(
    settings: Settings,
    sandbox_id: str,
    net: SandboxNetwork | None,
    *,
    rules: Literal["known", "lookup", "none"],
) -> None:
    netns = netns_name(sandbox_id)
    slot = net.slot if net else claimed_slots(settings).get(sandbox_id)
    if rules != "none":
        # The egress chain is named by the host interface, which is ours while the slot is.
        mine = slot is not None and _claimed_by(settings, slot) == sandbox_id
        chains = frozenset({f"{EGRESS_CHAIN_PREFIX}{HOST_IF_PREFIX}{slot}"} if mine else ())
        await _delete_tagged_rules(netns, net if rules == "known" else None, settings.sandbox_subnet, chains)
    if slot is not None:
        host_if = f"{HOST_IF_PREFIX}{slot}"
        # Deleting the netns destroys the veth pair only once no process holds the netns: the
        # link goes explicitly (first, so that its slot is free when it is released below).
        if _link_exists(host_if) and _claimed_by(settings, slot) == sandbox_id:
            await _forced(netlink.delete_link, host_if)
    if _netns_exists(netns):
        await _forced(netlink.delete_netns, netns)
    if slot is not None and _claimed_by(settings, slot) == sandbox_id:
        # Its domain rules go, and so do the connections the egress proxy still relays for it.
        egress_proxy.write_policy(settings, slot, None)
        await egress_proxy.drop(slot_addresses(settings, slot)[1])
        _release_slot(settings, slot)


async def _forced(fn: Callable[[str], None], name: str) -> None:
    """A teardown step that goes on past a failure (as ``ip -force`` did): logged, not raised."""
    try:
        await _off_loop(fn, name)
    except Exception as exc:
        log.warning("network teardown: %s(%s) failed: %s", fn.__name__, name, exc)


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


def list_orphans(settings: Settings, keep: set[str]) -> list[str]:
    """Sandbox ids with network resources of this data directory that are not in ``keep``.

    Only slots claimed under ``settings.data_dir`` count: an ``ae-`` netns without such a claim
    may belong to another forkyard instance (or test run) on the same host."""
    return sorted(sid for sid in claimed_slots(settings) if sid not in keep)


async def cleanup_orphans(settings: Settings, keep: set[str]) -> list[str]:
    orphans = list_orphans(settings, keep)
    for sandbox_id in orphans:
        await teardown_network(settings, sandbox_id)
    return orphans
