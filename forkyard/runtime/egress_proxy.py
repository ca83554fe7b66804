"""The node's egress proxy: domain names (and ``*.`` wildcards) in a sandbox's ``allow_out``.

E2B enforces domain entries in an egress proxy that reads a connection's TLS SNI (port 443) or
HTTP Host header (port 80); this is ours, one per server process, on the host. What reaches it
(see :mod:`forkyard.runtime.network`): a sandbox's new TCP connections to ports 80 and 443 that
its IP rules would drop, redirected (nat ``REDIRECT`` on the host side of its veth). Per
connection the proxy

1. finds the sandbox by the source address (a sandbox's /30 link address names its slot) and
   reads the slot's policy file (``{data_dir}/net/domains-<slot>.json``, written by the network
   layer; re-read when it changes, so an update applies to the next connection);
2. finds the original destination (``SO_ORIGINAL_DST``) and peeks at the first bytes: a TLS
   ClientHello's ``server_name`` on port 443, the ``Host`` of an HTTP/1 request on port 80;
3. when the name matches a domain rule, connects to that name as the *host* resolves it (E2B
   does the same: a sandbox that points an allowed name at another address in its own
   ``/etc/hosts`` or resolver still reaches the allowed name only), refusing resolved addresses
   the sandbox may not reach (private ranges, the node's networks, unless ``allow_out`` names
   them), replays the peeked bytes and splices both directions; otherwise it closes the
   connection (the sandbox sees it accepted, then closed: as in E2B, the firewall has to accept
   a connection before it can read a name).

No name (no SNI, an IP literal as Host, a malformed or truncated hello) is denied.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from forkyard.config import Settings

log = logging.getLogger(__name__)

#: ``getsockopt(SOL_IP, SO_ORIGINAL_DST)`` (linux/netfilter_ipv4.h): the address before REDIRECT.
SO_ORIGINAL_DST = 80
HTTP_PORT = 80
TLS_PORT = 443
#: How long a sandbox has to send its ClientHello or request head.
PEEK_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 10.0
#: A request head (port 80) or ClientHello (port 443) larger than this is refused.
MAX_PEEK_BYTES = 64 * 1024
RELAY_CHUNK = 64 * 1024
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME_RE = re.compile(rf"^({_LABEL}\.)*{_LABEL}$")


class Incomplete(Exception):
    """More bytes are needed before the name can be read."""


# -- names and rules ----------------------------------------------------------------------------


def normalise_name(name: str) -> str | None:
    """``name`` as a lowercase DNS name without the trailing dot, or None when it is not one
    (an IP literal, empty labels, characters outside a host name)."""
    name = name.strip().lower()
    name = name[:-1] if name.endswith(".") else name
    if not name or len(name) > 253 or not _NAME_RE.fullmatch(name):
        return None
    if not re.search(r"[a-z]", name.rsplit(".", 1)[-1]):
        return None  # the last label is numeric: an address, not a name
    return name


def normalise_rule(entry: str) -> str | None:
    """A domain rule as stored (``example.com``, ``*.example.com`` or ``*``), or None."""
    entry = entry.strip().lower()
    if entry.startswith("*."):
        suffix = normalise_name(entry[2:])
        return None if suffix is None else "*." + suffix
    return "*" if entry == "*" else normalise_name(entry)


def matches(name: str, rule: str) -> bool:
    """E2B's matching: exact (case-insensitive), ``*`` any name, ``*.x.y`` any name below
    ``x.y`` but not ``x.y`` itself. ``name`` and ``rule`` are normalised."""
    if rule == "*":
        return True
    if rule.startswith("*."):
        return name.endswith(rule[1:])
    return name == rule


# -- peeking: TLS ClientHello SNI ---------------------------------------------------------------


def _handshake_bytes(data: bytes) -> bytes:
    """The handshake-layer bytes of the TLS records at the start of ``data`` (a ClientHello may
    span records). Raises :class:`Incomplete` when a record is cut short and ValueError when
    ``data`` is not TLS handshake records."""
    out = bytearray()
    pos = 0
    while pos < len(data):
        if data[pos] != 0x16:
            raise ValueError("not a TLS handshake record")
        if len(data) - pos < 5:
            raise Incomplete
        kind, major, length = data[pos], data[pos + 1], struct.unpack_from("!H", data, pos + 3)[0]
        if kind != 0x16 or major != 3 or length == 0 or length > 2**14:
            raise ValueError("not a TLS handshake record")
        if len(data) - pos - 5 < length:
            out += data[pos + 5 :]
            return bytes(out)  # partial last record: the caller decides whether it is enough
        out += data[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if len(out) >= 4 and len(out) - 4 >= int.from_bytes(out[1:4], "big"):
            break
    return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated field")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack("!H", self.take(2))[0])

    def vector(self, length_bytes: int) -> bytes:
        n = self.u8() if length_bytes == 1 else self.u16()
        return self.take(n)


def parse_sni(data: bytes) -> str | None:
    """The ``server_name`` of the TLS ClientHello ``data`` starts with (normalised), or None when
    it has none or is not a well-formed ClientHello. Raises :class:`Incomplete` when ``data``
    stops before the hello does."""
    try:
        hs = _handshake_bytes(data)
    except ValueError:
        return None
    if len(hs) < 4:
        raise Incomplete
    if hs[0] != 0x01:  # not a ClientHello
        return None
    length = int.from_bytes(hs[1:4], "big")
    if length > MAX_PEEK_BYTES:
        return None
    if len(hs) - 4 < length:
        raise Incomplete
    try:
        return _sni_of_hello(hs[4 : 4 + length])
    except ValueError:
        return None


def _sni_of_hello(body: bytes) -> str | None:
    r = _Reader(body)
    r.take(2 + 32)  # legacy_version, random
    r.vector(1)  # legacy_session_id
    r.vector(2)  # cipher_suites
    r.vector(1)  # legacy_compression_methods
    if r.pos == len(body):
        return None  # no extensions at all
    ext = _Reader(r.vector(2))
    while ext.pos < len(ext.data):
        kind, data = ext.u16(), ext.vector(2)
        if kind == 0:  # server_name
            names = _Reader(_Reader(data).vector(2))
            while names.pos < len(names.data):
                name_type, name = names.u8(), names.vector(2)
                if name_type == 0:
                    return normalise_name(name.decode("ascii", errors="replace"))
            return None
    return None


# -- peeking: HTTP/1 Host -----------------------------------------------------------------------

_REQUEST_LINE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+ \S+ HTTP/1\.[01]$")


def parse_host(data: bytes) -> str | None:
    """The ``Host`` (normalised, port removed) of the HTTP/1 request ``data`` starts with, or None
    when it has none, has two, or is not an HTTP/1 request. Raises :class:`Incomplete` until the
    request head (up to the blank line) is there."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        first = data.split(b"\r\n", 1)
        if len(first) > 1 and not _REQUEST_LINE.match(first[0]):
            return None
        if len(data) > MAX_PEEK_BYTES:
            return None
        raise Incomplete
    lines = data[:end].split(b"\r\n")
    if not _REQUEST_LINE.match(lines[0]):
        return None
    hosts = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or name != name.strip():
            return None  # obs-fold or a space before the colon: refuse, never guess
        if name.lower() == b"host":
            hosts.append(value.strip())
    if len(hosts) != 1:
        return None
    host = hosts[0].decode("ascii", errors="replace")
    if host.startswith("["):
        return None  # an IPv6 literal
    hostname, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return normalise_name(hostname)


def peek_name(port: int, data: bytes) -> str | None:
    """The name a connection to ``port`` names in its first bytes (see :func:`parse_sni`,
    :func:`parse_host`); other ports carry none."""
    if port == TLS_PORT:
        return parse_sni(data)
    if port == HTTP_PORT:
        return parse_host(data)
    return None


# -- policies -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DomainPolicy:
    """What the proxy needs of one sandbox (the network layer writes it as JSON)."""

    sandbox_id: str
    sandbox_ip: str
    domains: tuple[str, ...]
    #: Networks resolved addresses may be in although ``denied`` covers them (``allow_out``).
    allowed: tuple[str, ...] = ()
    #: Networks a resolved address must not be in (private ranges, node networks, sandboxes).
    denied: tuple[str, ...] = ()

    def allows_name(self, name: str) -> bool:
        return any(matches(name, rule) for rule in self.domains)

    def allows_address(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        if ip.version != 4 or ip.is_loopback or ip.is_unspecified or ip.is_multicast:
            return False
        if any(ip in ipaddress.ip_network(n) for n in self.allowed):
            return True
        return not any(ip in ipaddress.ip_network(n) for n in self.denied)


def policy_path(settings: Settings, slot: int) -> Path:
    return settings.data_dir / "net" / f"domains-{slot}.json"


def write_policy(settings: Settings, slot: int, policy: DomainPolicy | None) -> None:
    """Publish (or, with None, withdraw) ``slot``'s policy: an atomic replace, so a connection
    reads the old policy or the new one."""
    path = policy_path(settings, slot)
    if policy is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    payload = {
        "sandbox_id": policy.sandbox_id,
        "sandbox_ip": policy.sandbox_ip,
        "domains": list(policy.domains),
        "allowed": list(policy.allowed),
        "denied": list(policy.denied),
    }
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _slot_of(settings: Settings, address: str) -> int | None:
    net = ipaddress.ip_network(settings.sandbox_subnet)
    ip = ipaddress.ip_address(address)
    if ip not in net:
        return None
    return (int(ip) - int(net.network_address)) // 4


# -- the proxy ----------------------------------------------------------------------------------


@dataclass
class EgressProxy:
    settings: Settings
    server: asyncio.Server | None = None
    port: int = 0
    #: Open connections by sandbox address: a teardown closes its sandbox's at once.
    connections: dict[str, set[asyncio.Task[None]]] = field(default_factory=dict)
    _cache: dict[int, tuple[tuple[int, int], DomainPolicy]] = field(default_factory=dict)

    async def start(self) -> int:
        """Listen (on every address: REDIRECT sends to the address of the veth a connection came
        in on); the port of the last run of this data directory when it is free, so the rules
        of sandboxes that outlived a restart keep pointing here."""
        port_file = self.settings.data_dir / "net" / "egress-proxy-port"
        with contextlib.suppress(OSError, ValueError):
            self.port = int(port_file.read_text())
        try:
            self.server = await asyncio.start_server(self._accept, "0.0.0.0", self.port, reuse_address=True)
        except OSError:
            log.warning(
                "egress proxy port %s is taken; sandboxes redirected to it lose domain rules", self.port
            )
            self.server = await asyncio.start_server(self._accept, "0.0.0.0", 0, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        port_file.parent.mkdir(parents=True, exist_ok=True)
        port_file.write_text(str(self.port))
        return self.port

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for address in list(self.connections):
            await self.drop(address)

    async def drop(self, sandbox_ip: str) -> None:
        """End every proxied connection of the sandbox at ``sandbox_ip`` (it is going away)."""
        tasks = self.connections.pop(sandbox_ip, set())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def policy_for(self, address: str) -> DomainPolicy | None:
        slot = _slot_of(self.settings, address)
        if slot is None:
            return None
        path = policy_path(self.settings, slot)
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_ino)
            cached = self._cache.get(slot)
            if cached and cached[0] == key:
                policy = cached[1]
            else:
                raw = json.loads(path.read_text())
                policy = DomainPolicy(
                    sandbox_id=raw["sandbox_id"],
                    sandbox_ip=raw["sandbox_ip"],
                    domains=tuple(raw["domains"]),
                    allowed=tuple(raw.get("allowed", ())),
                    denied=tuple(raw.get("denied", ())),
                )
                self._cache[slot] = (key, policy)
        except (OSError, ValueError, KeyError):
            self._cache.pop(slot, None)
            return None
        return policy if policy.sandbox_ip == address else None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        task = asyncio.current_task()
        assert task is not None
        self.connections.setdefault(peer, set()).add(task)
        try:
            await self._serve(peer, reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            tasks = self.connections.get(peer)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    self.connections.pop(peer, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        dst_ip, dst_port = original_destination(sock)
        if (dst_ip, dst_port) == sock.getsockname()[:2]:
            return  # not redirected: someone connected to the proxy itself
        policy = self.policy_for(peer)
        if policy is None:
            return
        data, name = await asyncio.wait_for(self._peek(dst_port, reader), PEEK_TIMEOUT_SECONDS)
        if name is None or not policy.allows_name(name):
            log.info(
                "egress: %s to %s:%s (%s) denied", policy.sandbox_id, dst_ip, dst_port, name or "no name"
            )
            return
        upstream = await self._connect(policy, name, dst_port)
        if upstream is None:
            return
        up_reader, up_writer = upstream
        try:
            up_writer.write(data)
            await asyncio.gather(_relay(reader, up_writer), _relay(up_reader, writer))
        finally:
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()

    async def _peek(self, port: int, reader: asyncio.StreamReader) -> tuple[bytes, str | None]:
        """The bytes read until the name could be decided, and the name (None: none or bad)."""
        data = b""
        while True:
            try:
                return data, peek_name(port, data)
            except Incomplete:
                pass
            if len(data) > MAX_PEEK_BYTES:
                return data, None
            chunk = await reader.read(RELAY_CHUNK)
            if not chunk:
                return data, None
            data += chunk

    async def _connect(
        self, policy: DomainPolicy, name: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        addresses = [a for a in await self._resolve(name) if policy.allows_address(a)]
        if not addresses:
            log.info("egress: %s may not reach what %s resolves to", policy.sandbox_id, name)
        for address in addresses:
            with contextlib.suppress(OSError, TimeoutError):
                return await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_SECONDS)
        return None

    async def _resolve(self, name: str) -> list[str]:
        """IPv4 addresses of ``name`` as the host resolves it (``settings.egress_resolver`` when
        set, else the system resolver)."""
        server = self.settings.egress_resolver
        if server:
            return await asyncio.to_thread(_query_a, server, name)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, None, family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except OSError:
            return []
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _query_a(server: str, name: str) -> list[str]:
    from dnslib import QTYPE, DNSRecord

    host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "53")
    try:
        reply = DNSRecord.parse(DNSRecord.question(name, "A").send(host, int(port or 53), timeout=3))
    except (OSError, ValueError):
        return []
    return [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), int(port)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close (the other direction may still be talking)."""
    try:
        while chunk := await reader.read(RELAY_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


# -- one proxy per process ----------------------------------------------------------------------

_proxy: EgressProxy | None = None
_starting: asyncio.Lock | None = None


async def ensure_started(settings: Settings) -> EgressProxy:
    """The process's proxy, started on first use (a sandbox whose policy names domains)."""
    global _proxy, _starting
    if _proxy is not None and _proxy.server is not None:
        return _proxy
    if _starting is None:
        _starting = asyncio.Lock()
    async with _starting:
        if _proxy is None or _proxy.server is None:
            proxy = EgressProxy(settings)
            await proxy.start()
            _proxy = proxy
    return _proxy


def has_policies(settings: Settings) -> bool:
    return any((settings.data_dir / "net").glob("domains-*.json"))


async def drop(sandbox_ip: str) -> None:
    if _proxy is not None:
        await _proxy.drop(sandbox_ip)


async def stop() -> None:
    global _proxy, _starting
    if _proxy is not None:
        await _proxy.close()
    _proxy, _starting = None, None
