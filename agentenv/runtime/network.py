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

Cost: creates, restores and kills run this for every sandbox, often many at once, so each step
is batched: a setup is one ``ip -batch`` on the host (netns, veth, host address), one in the
netns (sandbox address, links up, route) and one ``iptables-restore --noflush`` with all its
rules; a teardown is one ``iptables-restore`` (``-D`` lines) and one ``ip -batch``. Rule changes
of concurrent setups and teardowns in one process share a restore (``_RestoreQueue``).

Snapshot/restore: a checkpointed gVisor sandbox was addressed by its slot. Two ways to live with
that were on the table: (a) one fixed address inside every netns, each sandbox reached through
its own veth and a per-netns NAT, so a restored image fits any slot; (b) keep per-slot addresses
and give a restored sandbox the address of its own slot. gVisor's netstack owns the sandbox end
of the veth (the netns kernel never sees its packets), so (a) would need a second veth pair and
DNAT inside every netns, one more hop on every envd request. The gVisor runtime takes (b): a
resume keeps its slot, a restore into a new sandbox (fork child, create from a snapshot) gets a
new slot, and :func:`readdress` puts that slot's address on the link before ``runsc restore``
builds the restored netstack from it (see ``agentenv/runtime/gvisor/checkpoint.py``). QEMU guests
use a fixed guest address behind a tap instead (their own choice, inside the same netns).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import re
import subprocess
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from agentenv.config import Settings
from agentenv.errors import Failed, Invalid, Unavailable
from agentenv.storage.atomic import exclusive

NETNS_PREFIX = "ae-"
HOST_IF_PREFIX = "aeh"
SANDBOX_IF_PREFIX = "aes"
CHAIN = "AGENTENV"
NETNS_DIR = Path("/var/run/netns")
#: Serialises creation of the shared chains and hooks among all agentenv processes on the host.
GLOBAL_LOCK = Path("/run/agentenv-net.lock")


class NetworkError(Failed):
    """A network command failed, or the sandbox subnet cannot hold the link asked for."""


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


@dataclass(frozen=True)
class _BatchResult:
    code: int
    output: str
    #: Index of the line ``ip`` stopped at (it stops at the first failure unless forced).
    failed: int | None


async def _ip_batch(lines: list[str], *, netns: str | None = None, force: bool = False) -> _BatchResult:
    """Run ``ip`` commands (one per line, without the leading ``ip``) in one process, inside
    ``netns`` if given; ``force`` goes on past failures."""
    cmd = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"]
    code, out = await run(*cmd, check=False, input="".join(line + "\n" for line in lines))
    failed = None
    if code != 0:
        found = re.findall(r"^Command failed -:(\d+)$", out, re.M)
        failed = int(found[0]) - 1 if found else None
    return _BatchResult(code, out, failed)


def _batch_error(result: _BatchResult, lines: list[str], netns: str | None = None) -> NetworkError:
    where = f"-n {netns} " if netns else ""
    what = lines[result.failed] if result.failed is not None and result.failed < len(lines) else "-batch"
    return NetworkError(f"ip {where}{what} failed (exit {result.code}): {result.output}")


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


#: (table, hook chain, rule) of the jumps into the AGENTENV chains.
HOOKS: list[tuple[str, str, tuple[str, ...]]] = [
    ("filter", "INPUT", ("-i", HOST_IF_PREFIX + "+", "-j", CHAIN)),
    ("filter", "FORWARD", ("-j", CHAIN)),
    ("nat", "POSTROUTING", ("-j", CHAIN)),
]


async def ensure_chains() -> None:
    """Create the AGENTENV chains and their hooks once (idempotent, safe across processes)."""
    # In a thread: the flock may wait for another process, and must not block the event loop
    # (concurrent creates in this process would deadlock on it).
    await asyncio.to_thread(_ensure_chains_locked)


def _ensure_chains_locked() -> None:
    def iptables(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True)

    with exclusive(GLOBAL_LOCK):
        for table in ("filter", "nat"):
            proc = iptables("-t", table, "-N", CHAIN)
            if proc.returncode != 0 and "exists" not in proc.stderr:
                raise NetworkError(f"cannot create iptables chain {CHAIN} in {table}: {proc.stderr}")
        for table, hook, rule in HOOKS:
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


def _nat_rules(net: SandboxNetwork, subnet: str) -> list[list[str]]:
    if not net.allow_internet_access:
        return []
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
    """table -> the rules (in chain ``AGENTENV``, in order) that ``net`` gets."""
    return {"filter": _filter_rules(net, subnet), "nat": _nat_rules(net, subnet)}


def _rule_script(command: str, net: SandboxNetwork, subnet: str) -> Script:
    return {
        table: [" ".join([command, CHAIN, *rule]) for rule in rules]
        for table, rules in sandbox_rules(net, subnet).items()
    }


def _add_script(net: SandboxNetwork, subnet: str) -> Script:
    """Append ``net``'s rules after checking the hooks: a table's commit fails as a whole when a
    hook or chain is missing (flushed by someone since they were made, or never made)."""
    script = _rule_script("-A", net, subnet)
    for table, hook, rule in reversed(HOOKS):
        script[table].insert(0, " ".join(["-C", hook, *rule]))
    return script


async def _add_rules(net: SandboxNetwork, settings: Settings) -> None:
    if net.allow_internet_access:
        _enable_ip_forward()
    script = _add_script(net, settings.sandbox_subnet)
    if not await _restore_queue().apply(script):
        # Commits are per table, so one may have gone through: remove it before trying again.
        await _delete_tagged_rules(net.netns)
        await ensure_chains()
        await _iptables_restore(script)


def _tagged(line: str, tag: str) -> bool:
    line += " "
    return f"--comment {tag} " in line or f'--comment "{tag}" ' in line


async def _delete_tagged_rules(tag: str, net: SandboxNetwork | None = None, subnet: str = "") -> None:
    """Delete every rule tagged ``tag`` from the AGENTENV chains.

    With ``net`` its rules are deleted as they were made (no lookup); when that fails (some are
    gone, or were made with other settings) and without ``net`` they are looked up."""
    if net is not None and await _restore_queue().apply(_rule_script("-D", net, subnet)):
        return
    for _ in range(3):  # a rule deleted meanwhile (a concurrent teardown) fails the whole commit
        code, out = await run("iptables-save", check=False)
        if code != 0:
            return
        deletes: Script = {table: [] for table in TABLES}
        table = ""
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:].strip()
            elif table in deletes and line.startswith(f"-A {CHAIN} ") and _tagged(line, tag):
                deletes[table].append("-D" + line[2:])
        if not any(deletes.values()) or (await _iptables_restore(deletes, check=False))[0] == 0:
            return


def _enable_ip_forward() -> None:
    path = Path("/proc/sys/net/ipv4/ip_forward")
    if path.read_text().strip() != "1":
        path.write_text("1\n")


# -- lifecycle ----------------------------------------------------------------------------------


class _NetnsExists(NetworkError):
    """``ip netns add`` failed: the namespace is not ours to remove."""


async def setup_network(
    settings: Settings, sandbox_id: str, *, allow_internet_access: bool
) -> SandboxNetwork:
    """Create the netns, link and filter rules of ``sandbox_id``; on failure nothing is left.

    Three processes: ``ip -batch`` on the host, ``ip -batch`` in the netns, ``iptables-restore``
    (shared with concurrent setups and teardowns)."""
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
        await _add_rules(net, settings)
    except _NetnsExists:
        raise
    except BaseException:
        # Rules that failed to go in may have gone in partly: look them up rather than guess.
        await _teardown(settings, sandbox_id, net, rules="lookup" if rules_tried else "none")
        raise
    return net


async def _create_link(settings: Settings, net: SandboxNetwork, *, add_netns: bool) -> SandboxNetwork | None:
    """The netns (unless it is there already), the veth pair and the host side's address; None
    when another data directory took the interface name first (the slot is released)."""
    lines = [f"netns add {net.netns}"] if add_netns else []
    link = len(lines)
    lines += [
        f"link add {net.host_if} type veth peer name {net.sandbox_if} netns {net.netns}",
        f"addr add {net.host_ip}/{net.prefixlen} dev {net.host_if}",
        f"link set {net.host_if} up",
    ]
    result = await _ip_batch(lines)
    if result.code == 0:
        return net
    if result.failed is None or result.failed > link:
        raise _batch_error(result, lines)  # the veth may be there: the caller cleans up
    _release_slot(settings, net.slot)
    if result.failed < link:
        raise _NetnsExists(_batch_error(result, lines).message)
    if "exists" in result.output:
        return None
    raise _batch_error(result, lines)


async def _configure_netns(net: SandboxNetwork) -> None:
    lines = [
        f"addr add {net.sandbox_ip}/{net.prefixlen} dev {net.sandbox_if}",
        f"link set {net.sandbox_if} up",
        "link set lo up",
        f"route add default via {net.host_ip}",
    ]
    result = await _ip_batch(lines, netns=net.netns)
    if result.code != 0:
        raise _batch_error(result, lines, net.netns)


async def readdress(net: SandboxNetwork) -> None:
    """Put the sandbox address and default route (back) on the netns side of the veth, replacing
    what is there: one ``ip`` process (a restore runs this before ``runsc restore``)."""
    lines = [
        f"addr replace {net.sandbox_ip}/{net.prefixlen} dev {net.sandbox_if}",
        f"route replace default via {net.host_ip} dev {net.sandbox_if}",
    ]
    result = await _ip_batch(lines, netns=net.netns)
    if result.code != 0:
        raise _batch_error(result, lines, net.netns)


async def teardown_network(settings: Settings, sandbox_id: str, net: SandboxNetwork | None = None) -> None:
    """Remove the netns, link, rules and slot of ``sandbox_id``. Idempotent; works without
    ``net`` (state lost in a crash) by finding the slot from this data directory's claims.

    Two processes: ``iptables-restore`` (shared with concurrent setups and teardowns; without
    ``net``, or when ``net``'s rules are not all there, ``iptables-save`` first) and ``ip -batch``."""
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
        await _delete_tagged_rules(netns, net if rules == "known" else None, settings.sandbox_subnet)
    lines = []
    if _netns_exists(netns):
        lines.append(f"netns del {netns}")
    if slot is not None:
        host_if = f"{HOST_IF_PREFIX}{slot}"
        # Deleting the netns destroys the veth pair, unless a process still holds the netns.
        if _link_exists(host_if) and _claimed_by(settings, slot) == sandbox_id:
            lines.append(f"link del {host_if}")
    if lines:
        await _ip_batch(lines, force=True)
    if slot is not None and _claimed_by(settings, slot) == sandbox_id:
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
