"""What a sandbox (or a whole test session) leaves on the host.

Every probe returns what it found, so an assertion prints the leak itself::

    assert leaks.host_resources(sandbox_id) == []
    assert leaks.wait_no_host_resources(sandbox_id) == []   # after an asynchronous kill

Runtime-specific leftovers (runsc state, cgroups, a VM's directory) stay in the runtime's tests,
built on these probes. :func:`host_state` / :meth:`HostState.new_since` compare the whole host
before and after (the session check of :mod:`tests.support.fixtures`).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: Kept equal to forkyard.runtime.network (NETNS_DIR, NETNS_PREFIX, HOST_IF_PREFIX); read from
#: there when it imports, so a rename in the product does not blind the probes.
NETNS_DIR = Path("/var/run/netns")
NETNS_PREFIX = "ae-"
HOST_IF_PREFIX = "aeh"
#: Programs that run a sandbox, matched on the executable's name (argv[0]): runsc re-executes
#: itself as runsc-sandbox / runsc-gofer. The Firecracker uffd page server is a python module.
SANDBOX_PROGRAMS = ("runsc", "qemu-system", "firecracker")
SANDBOX_MODULES = ("forkyard.runtime.firecracker.uffd",)


def _network_names() -> tuple[Path, str, str]:
    try:
        from forkyard.runtime import network
    except ImportError:
        return NETNS_DIR, NETNS_PREFIX, HOST_IF_PREFIX
    return (
        getattr(network, "NETNS_DIR", NETNS_DIR),
        getattr(network, "NETNS_PREFIX", NETNS_PREFIX),
        getattr(network, "HOST_IF_PREFIX", HOST_IF_PREFIX),
    )


# -- mounts ------------------------------------------------------------------------------------


def _mount_lines() -> list[str]:
    return Path("/proc/mounts").read_text().splitlines()


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mounts_under(path: Path | str) -> list[str]:
    """Mount points at or below ``path`` (never ``rm -rf`` a directory while this is not empty)."""
    root = os.path.abspath(path)
    found = []
    for line in _mount_lines():
        point = _unescape(line.split()[1])
        if point == root or point.startswith(root + "/"):
            found.append(point)
    return found


def mounts_naming(text: str) -> list[str]:
    """Lines of /proc/mounts that mention ``text`` anywhere (mount point, source or options)."""
    return [line for line in _mount_lines() if text in line]


# -- network -----------------------------------------------------------------------------------


def netns_exists(sandbox_id: str) -> bool:
    """The sandbox's own network namespace (``ae-<id>``) is still there."""
    netns_dir, prefix, _ = _network_names()
    return (netns_dir / f"{prefix}{sandbox_id}").exists()


def forkyard_netns() -> set[str]:
    """Every forkyard network namespace on the host (``ae-*``)."""
    netns_dir, prefix, _ = _network_names()
    try:
        return {p.name for p in netns_dir.iterdir() if p.name.startswith(prefix)}
    except FileNotFoundError:
        return set()


def host_links(prefix: str | None = None) -> set[str]:
    """Host network interfaces named ``prefix*`` (default: forkyard's host-side veths, ``aeh*``)."""
    prefix = prefix if prefix is not None else _network_names()[2]
    return {p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(prefix)}


def link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


# -- firewall and egress proxy -----------------------------------------------------------------

#: Per-sandbox iptables chains (forkyard.runtime.network): egress filter, egress proxy redirect.
SANDBOX_CHAIN_PREFIXES = ("AEO-", "AEP-")


def _iptables_save() -> list[tuple[str, str]]:
    """(table, line) of every rule and chain on the host."""
    try:
        out = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    except FileNotFoundError:  # no iptables on this host: no rules either
        return []
    table, lines = "", []
    for line in out.splitlines():
        if line.startswith("*"):
            table = line[1:]
        lines.append((table, line))
    return lines


def sandbox_chains() -> set[str]:
    """``table:chain`` of every per-sandbox chain on the host."""
    return {
        f"{table}:{line[1:].split()[0]}"
        for table, line in _iptables_save()
        if line.startswith(tuple(":" + p for p in SANDBOX_CHAIN_PREFIXES))
    }


def firewall_resources(sandbox_id: str) -> list[str]:
    """iptables rules tagged with the sandbox's netns name, and per-sandbox chains whose host
    interface is gone (a chain is named by the interface, not the sandbox)."""
    _, prefix, _ = _network_names()
    tag = f"--comment {prefix}{sandbox_id}"
    found = [f"rule {table}: {line}" for table, line in _iptables_save() if (line + " ").count(tag + " ")]
    for chain in sorted(sandbox_chains()):
        interface = chain.split(":", 1)[1].split("-", 1)[1]
        if not link_exists(interface):
            found.append(f"orphan chain {chain}")
    return found


def sandbox_address(data_dir: Path, sandbox_id: str) -> str | None:
    """The sandbox end of the sandbox's /30 link (its slot's host address + 1), from the slot
    claims of ``data_dir`` and the host interface."""
    import ipaddress
    import socket

    import psutil

    _, _, host_prefix = _network_names()
    for claim in (data_dir / "net").glob("slot-*"):
        if claim.read_text().strip() != sandbox_id:
            continue
        for addr in psutil.net_if_addrs().get(host_prefix + claim.name.removeprefix("slot-"), []):
            if addr.family == socket.AF_INET:
                return str(ipaddress.ip_address(addr.address) + 1)
    return None


def proxy_connections(data_dir: Path, sandbox_ip: str) -> list[str]:
    """TCP connections the egress proxy of ``data_dir``'s server holds open for ``sandbox_ip``
    (a socket it has closed, left to the kernel in FIN_WAIT or TIME_WAIT, has no process)."""
    import psutil

    try:
        port = int((data_dir / "net" / "egress-proxy-port").read_text())
    except (OSError, ValueError):
        return []
    return [
        f"{c.laddr.ip}:{c.laddr.port} <- {c.raddr.ip}:{c.raddr.port} {c.status}"
        for c in psutil.net_connections(kind="tcp")
        if c.raddr and c.raddr.ip == sandbox_ip and c.laddr.port == port and c.pid is not None
    ]


def wait_no_proxy_connections(data_dir: Path, sandbox_ip: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = proxy_connections(data_dir, sandbox_ip)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


# -- processes ---------------------------------------------------------------------------------


def _command_lines() -> list[tuple[int, list[str]]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        argv = raw.decode(errors="replace").split("\0")
        if argv and argv[-1] == "":
            argv.pop()
        if argv:
            found.append((int(entry.name), argv))
    return found


def _describe(pid: int, argv: list[str]) -> str:
    return f"{pid} {' '.join(argv)[:200]}"


def processes(*needles: str) -> list[str]:
    """``"<pid> <command line>"`` of every process whose command line contains all ``needles``
    (not this process)."""
    return [
        _describe(pid, argv)
        for pid, argv in _command_lines()
        if all(needle in " ".join(argv) for needle in needles)
    ]


#: Set by each pytest session (tests/conftest.py) and inherited by whatever it starts: two sessions
#: run side by side in `make test` (scripts/test.sh), and each one's host check leaves the other's
#: processes alone.
SESSION_ENV = "FORKYARD_TEST_SESSION"


#: A Docker container's cgroup, as /proc/<pid>/cgroup names it: ``/docker/<id>`` (cgroupfs driver)
#: or ``/system.slice/docker-<id>.scope`` (systemd driver), in any hierarchy.
_DOCKER_CGROUP = re.compile(r"/docker[/-]([0-9a-f]{64})(?:\.scope)?(?:/|$)")


def container_of(cgroup: str) -> str | None:
    """The Docker container (its id) a process runs in, from the text of its /proc/<pid>/cgroup;
    None: the host's own."""
    for line in cgroup.splitlines():
        found = _DOCKER_CGROUP.search(line.split(":", 2)[-1])
        if found:
            return found.group(1)
    return None


def _session_of(pid: int) -> str | None:
    """The test session that started ``pid`` (None: none, or its environment is unreadable).
    A process in a Docker container (the Compose cluster's nodes run their sandboxes so, with
    an environment of their own) belongs to that container, never to a session of the host:
    ``docker:<id>``."""
    try:
        container = container_of(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        container = None
    if container is not None:
        return f"docker:{container[:12]}"
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = SESSION_ENV.encode() + b"="
    for entry in environ:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _this_sessions(pid: int, *, surely: bool) -> bool:
    """``pid`` was started by this test session: ``surely`` when it carries this session's mark,
    else unless it carries another's (runsc may start a sandbox's processes with a clean
    environment: unmarked ones count as ours)."""
    mine = os.environ.get(SESSION_ENV)
    theirs = _session_of(pid)
    if surely:
        return mine is not None and theirs == mine
    return mine is None or theirs is None or theirs == mine


def _is_sandbox_program(argv: list[str]) -> bool:
    name = os.path.basename(argv[0].split()[0]) if argv[0].strip() else ""
    return name.startswith(SANDBOX_PROGRAMS) or any(module in argv for module in SANDBOX_MODULES)


def sandbox_processes(text: str = "") -> list[str]:
    """runsc, QEMU and Firecracker processes (by executable, not a shell or a ``flock`` that merely
    names one) whose command line contains ``text``; all of them when empty."""
    return [
        _describe(pid, argv)
        for pid, argv in _command_lines()
        if _is_sandbox_program(argv) and text in " ".join(argv)
    ]


# -- one sandbox -------------------------------------------------------------------------------


def host_resources(sandbox_id: str) -> list[str]:
    """Host resources still named after ``sandbox_id``: its network namespace, sandbox processes
    naming it, mounts naming it. Empty once the sandbox is fully gone."""
    netns_dir, _, _ = _network_names()
    found: list[str] = []
    if netns_dir.is_dir():
        found += [f"netns {p.name}" for p in netns_dir.iterdir() if sandbox_id in p.name]
    found += [f"process {line}" for line in sandbox_processes(sandbox_id)]
    found += [f"mount {line}" for line in mounts_naming(sandbox_id)]
    return found


def wait_no_host_resources(sandbox_id: str, timeout: float = 15) -> list[str]:
    """:func:`host_resources`, polled until empty or ``timeout`` (a kill may finish asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        left = host_resources(sandbox_id)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


# -- the whole host ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HostState:
    netns: frozenset[str]
    links: frozenset[str]
    processes: dict[int, str]  # pid -> "<pid> <command line>" of sandbox programs
    chains: frozenset[str] = frozenset()  # table:chain of per-sandbox iptables chains

    def new_since(self, before: HostState) -> list[str]:
        """What exists now and did not exist in ``before``."""
        new_processes = [line for pid, line in sorted(self.processes.items()) if pid not in before.processes]
        return (
            [f"netns {n}" for n in sorted(self.netns - before.netns)]
            + [f"veth {n}" for n in sorted(self.links - before.links)]
            + [f"process {line}" for line in new_processes]
            + [f"iptables chain {c}" for c in sorted(self.chains - before.chains)]
        )


def host_state(*, processes_only: bool = False) -> HostState:
    """The host's sandbox resources now, without the processes of another test session running
    beside this one. ``processes_only``: a session that makes no host network resources (the
    emulated KVM host's, whose sandboxes live inside its QEMU) looks only at the processes it
    surely started, since namespaces, veths and unmarked processes cannot be told apart by session."""
    programs = {
        pid: line
        for line in sandbox_processes()
        if _this_sessions(pid := int(line.split(" ", 1)[0]), surely=processes_only)
    }
    if processes_only:
        return HostState(frozenset(), frozenset(), programs)
    return HostState(
        frozenset(forkyard_netns()), frozenset(host_links()), programs, frozenset(sandbox_chains())
    )


def wait_host_clean(before: HostState, timeout: float = 10, *, processes_only: bool = False) -> list[str]:
    """What appeared on the host since ``before``, polled until nothing or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        new = host_state(processes_only=processes_only).new_since(before)
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.25)
