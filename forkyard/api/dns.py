"""A tiny DNS responder for sandbox URL names (``FORKYARD_DNS_LISTEN``, off by default).

It answers ``A`` queries for ``{sandbox_domain}`` and every name under it with the address the
HTTPS listener serves on (``AAAA``: an empty answer, so clients fall back to IPv4 at once) and
forwards every other query, unchanged, to an upstream resolver (``FORKYARD_DNS_UPSTREAM``, else
the first nameserver of /etc/resolv.conf that is not this responder). So it works both ways a
stock Debian host can use it (README, "Sandbox URLs"): as the only nameserver in
/etc/resolv.conf, or as the per-domain server systemd-resolved asks for ``~{sandbox_domain}``.

One UDP socket, no threads: idle it costs nothing. dnslib (pinned) parses and builds packets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import cast

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.dns import DNSError

from forkyard.errors import Invalid

log = logging.getLogger(__name__)

TTL = 60
UPSTREAM_TIMEOUT = 3.0
RESOLV_CONF = Path("/etc/resolv.conf")


def parse_endpoint(value: str, default_port: int = 53) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = value, str(default_port)
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise Invalid(f"invalid DNS endpoint {value!r}: expected address[:port]")
    return host, int(port)


def system_upstream(exclude: tuple[str, int]) -> tuple[str, int] | None:
    """The first nameserver of /etc/resolv.conf other than ``exclude`` (the responder)."""
    try:
        lines = RESOLV_CONF.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver" and (parts[1], 53) != exclude:
            return parts[1], 53
    return None


class SandboxDns(asyncio.DatagramProtocol):
    """Answers for ``*.{domain}``, forwards the rest to ``upstream`` (REFUSED without one)."""

    def __init__(self, domain: str, address: str, upstream: tuple[str, int] | None) -> None:
        self.domain = domain.lower().rstrip(".")
        self.address = address
        self.upstream = upstream
        self.transport: asyncio.DatagramTransport | None = None
        self._pending: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def ours(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return name == self.domain or name.endswith("." + self.domain)

    def answer(self, query: DNSRecord) -> DNSRecord:
        reply = query.reply()  # authoritative, recursion available: what stub resolvers want
        qname, qtype = query.q.qname, query.q.qtype
        if qtype in (QTYPE.A, QTYPE.ANY):
            reply.add_answer(RR(qname, QTYPE.A, rdata=A(self.address), ttl=TTL))
        elif qtype == QTYPE.AAAA and ":" in self.address:
            reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(self.address), ttl=TTL))
        return reply

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = DNSRecord.parse(data)
        except (DNSError, ValueError, IndexError):
            return  # not DNS: nothing to answer
        if self.ours(str(query.q.qname)):
            self._send(self.answer(query).pack(), addr)
        elif self.upstream is None:
            reply = query.reply()
            reply.header.rcode = RCODE.REFUSED
            self._send(reply.pack(), addr)
        else:
            task = asyncio.ensure_future(self._forward(data, query, addr))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _forward(self, data: bytes, query: DNSRecord, addr: tuple[str, int]) -> None:
        assert self.upstream is not None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bytes] = loop.create_future()

        class Once(asyncio.DatagramProtocol):
            def datagram_received(self, answer: bytes, _: tuple[str, int]) -> None:
                if not done.done():
                    done.set_result(answer)

        transport, _ = await loop.create_datagram_endpoint(Once, remote_addr=self.upstream)
        try:
            transport.sendto(data)
            self._send(await asyncio.wait_for(done, UPSTREAM_TIMEOUT), addr)
        except TimeoutError:
            reply = query.reply()
            reply.header.rcode = RCODE.SERVFAIL
            self._send(reply.pack(), addr)
        finally:
            transport.close()

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(data, addr)

    def close(self) -> None:
        for task in self._pending:
            task.cancel()
        if self.transport is not None:
            self.transport.close()


async def start_dns(
    listen: str, domain: str, address: str, upstream: str = ""
) -> tuple[SandboxDns, tuple[str, int]]:
    """Bind the responder; (protocol, the address it listens on). Raises :class:`Invalid` when
    the address cannot be bound (say, another server holds it)."""
    host, port = parse_endpoint(listen)
    forward = parse_endpoint(upstream) if upstream else system_upstream((host, port))
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: SandboxDns(domain, address, forward), local_addr=(host, port)
        )
    except OSError as exc:
        raise Invalid(f"cannot listen for DNS on {listen}: {exc.strerror or exc}") from exc
    bound = transport.get_extra_info("sockname")
    with contextlib.suppress(Exception):
        log.info("DNS for *.%s on %s:%s (others to %s)", domain, bound[0], bound[1], forward or "nowhere")
    return protocol, (str(bound[0]), int(bound[1]))
