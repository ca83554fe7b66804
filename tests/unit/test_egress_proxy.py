"""The egress proxy's parts that need no root: reading the TLS SNI of real ClientHellos (made by
Python's own TLS stack, then cut and re-fragmented), the HTTP/1 Host, E2B's domain matching, and
the per-slot policy files the proxy reads."""

from __future__ import annotations

import ssl
import struct
from pathlib import Path

import pytest

from forkyard.config import Settings
from forkyard.runtime import egress_proxy as ep


def client_hello(server_hostname: str | None) -> bytes:
    """The first flight of a real TLS client (one record holding its ClientHello)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def refragment(record: bytes, size: int) -> bytes:
    """The handshake bytes of ``record`` re-cut into TLS records of ``size`` bytes each."""
    body = record[5:]
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"\x16\x03\x01" + struct.pack("!H", len(c)) + c for c in chunks)


def test_sni_of_a_real_client_hello() -> None:
    hello = client_hello("API.Example.COM")
    assert ep.parse_sni(hello) == "api.example.com"
    assert ep.parse_sni(hello + b"\x17\x03\x03\x00\x01x") == "api.example.com"  # bytes after it
    assert ep.parse_sni(client_hello(None)) is None  # no server_name: no name, denied


def test_a_hello_fragmented_over_records_and_reads_is_read_whole() -> None:
    hello = client_hello("a.example.org")
    for size in (1, 7, 100):
        fragmented = refragment(hello, size)
        assert ep.parse_sni(fragmented) == "a.example.org"
        # Every cut short of the end asks for more bytes (as TCP reads deliver them).
        for cut in range(0, len(fragmented), max(1, len(fragmented) // 40)):
            with pytest.raises(ep.Incomplete):
                ep.parse_sni(fragmented[:cut])


def test_truncated_and_malformed_hellos_are_incomplete_or_denied() -> None:
    hello = bytearray(client_hello("x.example.com"))
    with pytest.raises(ep.Incomplete):
        ep.parse_sni(bytes(hello[:-1]))
    assert ep.parse_sni(b"GET / HTTP/1.1\r\n") is None  # not TLS
    assert ep.parse_sni(b"\x15\x03\x01\x00\x02\x02\x28") is None  # an alert, not a handshake
    assert ep.parse_sni(b"\x16\x03\x01\x00\x04\x02\x00\x00\x00") is None  # a ServerHello
    # The handshake claims more bytes than its record and the session id overruns the hello.
    broken = bytearray(hello)
    broken[5 + 4 + 34] = 0xFF  # legacy_session_id length
    assert ep.parse_sni(bytes(broken)) is None
    huge = b"\x16\x03\x01\x40\x00\x01\xff\xff\xff" + b"\x00" * (2**14 - 4)
    assert ep.parse_sni(huge) is None  # a hello larger than the proxy reads
    # A server_name that is not a host name (an address, a bad label).
    for name in ("10.0.0.1", "bad..name"):
        raw = bytes(hello).replace(b"x.example.com", name.encode().ljust(13, b"."))
        assert ep.parse_sni(raw) is None


def test_http_host() -> None:
    assert ep.parse_host(b"GET / HTTP/1.1\r\nHost: Example.com:8080\r\nAccept: */*\r\n\r\n") == "example.com"
    assert ep.parse_host(b"POST /x HTTP/1.0\r\nhost:a.b.example.org\r\n\r\nbody") == "a.b.example.org"
    with pytest.raises(ep.Incomplete):
        ep.parse_host(b"GET / HTTP/1.1\r\nHost: exa")
    with pytest.raises(ep.Incomplete):
        ep.parse_host(b"GE")
    for bad in (
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a.com\r\nHost: b.com\r\n\r\n",  # two
        b"GET / HTTP/1.1\r\nHost : a.com\r\n\r\n",  # space before the colon
        b"GET / HTTP/1.1\r\nHost: 1.2.3.4\r\n\r\n",  # an address
        b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a.com:x\r\n\r\n",
        b"\x16\x03\x01\x00\x10\r\nHost: a.com\r\n\r\n",  # not a request line
        b"GET / HTTP/2.0\r\nHost: a.com\r\n\r\n",
    ):
        assert ep.parse_host(bad) is None, bad
    assert ep.parse_host(b"GET /" + b"a" * ep.MAX_PEEK_BYTES) is None  # a head that never ends


def test_e2b_domain_matching() -> None:
    assert ep.normalise_rule("*.Example.COM.") == "*.example.com"
    assert ep.normalise_rule("*") == "*"
    for bad in ("*.*.a.com", "a*.com", "", "a..b", "10.0.0.1", "*."):
        assert ep.normalise_rule(bad) is None, bad
    assert ep.matches("example.com", "example.com")
    assert not ep.matches("www.example.com", "example.com")
    assert ep.matches("www.example.com", "*.example.com")
    assert ep.matches("a.b.example.com", "*.example.com")
    assert not ep.matches("example.com", "*.example.com")  # the wildcard is below the name only
    assert not ep.matches("badexample.com", "*.example.com")
    assert ep.matches("anything.test", "*")


def test_policy_files_are_per_slot_and_checked_against_the_source(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, sandbox_subnet="10.213.0.0/16")
    proxy = ep.EgressProxy(settings)
    policy = ep.DomainPolicy(
        sandbox_id="s1",
        sandbox_ip="10.213.0.22",
        domains=("example.com",),
        allowed=("10.9.0.0/16",),
        denied=("10.0.0.0/8", "198.19.0.0/30"),
    )
    ep.write_policy(settings, 5, policy)
    assert proxy.policy_for("10.213.0.22") == policy
    assert proxy.policy_for("10.213.0.21") is None  # the slot's host address is not the sandbox
    assert proxy.policy_for("10.213.0.26") is None  # slot 6: no policy
    assert proxy.policy_for("192.0.2.1") is None  # not a sandbox at all
    ep.write_policy(settings, 5, ep.DomainPolicy("s1", "10.213.0.22", ("*.example.org",)))
    updated = proxy.policy_for("10.213.0.22")
    assert (
        updated is not None
        and updated.allows_name("a.example.org")
        and not updated.allows_name("example.com")
    )
    ep.write_policy(settings, 5, None)
    assert proxy.policy_for("10.213.0.22") is None and not ep.has_policies(settings)
    assert policy.allows_address("203.0.113.10")
    assert policy.allows_address("10.9.1.1")  # allow_out beats the private-range default
    for denied in ("10.1.1.1", "198.19.0.1", "127.0.0.1", "0.0.0.0", "224.0.0.1"):
        assert not policy.allows_address(denied), denied
