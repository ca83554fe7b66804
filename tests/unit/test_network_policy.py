"""The parts of network policy and sandbox URLs that need no root: parsing a policy, the order of
a sandbox's egress chain, the CA and certificate, the DNS responder's answers."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from dnslib import QTYPE, DNSRecord

from forkyard.api import dns, tls
from forkyard.api.routes_network import check_mask
from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.runtime import egress_policy, network
from forkyard.types import EgressPolicy


def test_policies_are_parsed_as_e2b_does() -> None:
    policy = egress_policy.parse_egress(["1.2.3.4", "10.1.2.3/8", "1.2.3.4/32"], ["0.0.0.0/0"])
    assert policy == EgressPolicy(allow_out=("1.2.3.4/32", "10.0.0.0/8"), deny_out=("0.0.0.0/0",))
    for allow, deny, message in [
        (["example.com"], None, "you must include 'ALL_TRAFFIC' in deny out"),
        (["*.example.com"], ["10.0.0.0/8"], "you must include 'ALL_TRAFFIC' in deny out"),
        (["a..example.com"], ["0.0.0.0/0"], "invalid allowOut entry"),
        (["*.*.example.com"], ["0.0.0.0/0"], "invalid allowOut entry"),
        (["10.0.0.300"], None, "invalid allowOut entry"),
        (["fe80::1"], None, "IPv4 only"),
        ([""], None, "invalid allowOut entry"),
        (None, ["example.com"], "invalid denied CIDR example.com"),
        (None, ["1.2.3.4/33"], "invalid denied CIDR"),
        (["1.1.1.1"] * 257, None, "at most 256"),
    ]:
        with pytest.raises(Invalid, match=message):
            egress_policy.parse_egress(allow, deny)


def test_domain_rules_are_split_from_networks_and_open_the_resolvers() -> None:
    policy = egress_policy.parse_egress(["Example.COM.", "1.2.3.4", "*.Example.org", "*"], ["0.0.0.0/0"])
    assert policy == EgressPolicy(
        allow_out=("1.2.3.4/32",),
        deny_out=("0.0.0.0/0",),
        allow_domains=("example.com", "*.example.org", "*"),
        resolvers=egress_policy.DEFAULT_RESOLVERS,
    )
    closed = egress_policy.parse_egress(["example.com"], None, dns_servers=["9.9.9.9"], internet_closed=True)
    assert closed.allow_domains == ("example.com",) and closed.resolvers == ("9.9.9.9",)
    assert egress_policy.parse_egress(["1.2.3.4"], None, dns_servers=["9.9.9.9"]).resolvers == ()
    rules = network.egress_rules(True, closed)
    assert ["-d", "9.9.9.9/32", "-p", "udp", "--dport", "53", "-j", "ACCEPT"] in rules
    assert ["-d", "9.9.9.9/32", "-p", "tcp", "--dport", "53", "-j", "ACCEPT"] in rules


def test_only_domain_policies_redirect_and_allow_out_goes_around_the_proxy() -> None:
    subnet = "10.213.0.0/16"
    assert network.redirect_rules(subnet, None, 4000) == []
    assert network.redirect_rules(subnet, EgressPolicy(allow_out=("1.2.3.4/32",)), 4000) == []
    policy = egress_policy.parse_egress(["example.com", "1.2.3.0/24"], ["0.0.0.0/0"])
    rules = network.redirect_rules(subnet, policy, 4000)
    assert rules[:3] == [
        ["-m", "addrtype", "--dst-type", "LOCAL", "-j", "RETURN"],
        ["-d", subnet, "-j", "RETURN"],
        ["-d", "1.2.3.0/24", "-j", "RETURN"],
    ]
    assert rules[-1] == [
        "-p",
        "tcp",
        "-m",
        "multiport",
        "--dports",
        "80,443",
        "-j",
        "REDIRECT",
        "--to-ports",
        "4000",
    ]


def test_the_egress_chain_allows_first_then_denies_defaults_then_the_policy() -> None:
    rules = network.egress_rules(False, EgressPolicy(allow_out=("10.9.0.0/16",), deny_out=("8.8.8.8/32",)))
    verdicts = [(r[1] if r[0] == "-d" else "*", r[-1]) for r in rules]
    assert verdicts[0] == ("10.9.0.0/16", "ACCEPT")
    defaults = [cidr for cidr, verdict in verdicts[1:-2] if verdict == "DROP"]
    assert set(network.DEFAULT_DENIED) <= set(defaults)
    assert verdicts[-2:] == [("8.8.8.8/32", "DROP"), ("*", "DROP")]
    assert network.egress_rules(True, None)[-1] == ["-j", "ACCEPT"]


def test_mask_request_host_is_checked() -> None:
    assert check_mask("${PORT}-app.example.com:8443") == "${PORT}-app.example.com:8443"
    for bad in ("a b", "évil.com", "x\r\nY: 1", "host:99999999", ""):
        with pytest.raises(Invalid):
            check_mask(bad)


def test_the_ca_is_made_once_and_signs_a_wildcard_for_the_domain(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, sandbox_domain="sbx.example.test", tls_port=8443)
    first = tls.ensure_tls(settings)
    ca_before = first.ca.read_bytes()
    second = tls.ensure_tls(settings)
    assert second.ca.read_bytes() == ca_before  # clients trust it once
    assert (tmp_path / "tls" / "ca-key.pem").stat().st_mode & 0o077 == 0
    leaf = x509.load_pem_x509_certificates(second.cert.read_bytes())[0]
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "*.sbx.example.test" in names.get_values_for_type(x509.DNSName)
    ctx = ssl.create_default_context(cafile=str(second.bundle))  # loads: the bundle parses
    assert ctx.cert_store_stats()["x509_ca"] >= 1
    assert tls.https_domain(settings) == "sbx.example.test:8443"
    with pytest.raises(Invalid, match="two labels"):
        tls.check_domain("localhost")


async def test_the_responder_answers_its_domain_and_refuses_without_upstream() -> None:
    protocol, (host, port) = await dns.start_dns("127.0.0.1:0", "forkyard.localhost", "127.0.0.9", "")
    protocol.upstream = None
    loop = asyncio.get_running_loop()

    def ask(name: str, qtype: str = "A") -> DNSRecord:
        return DNSRecord.parse(DNSRecord.question(name, qtype).send(host, port, timeout=3))

    try:
        ours = await loop.run_in_executor(None, ask, "3000-iabc.Forkyard.Localhost")
        assert [str(rr.rdata) for rr in ours.rr if rr.rtype == QTYPE.A] == ["127.0.0.9"]
        assert (await loop.run_in_executor(None, ask, "3000-iabc.forkyard.localhost", "AAAA")).rr == []
        other = await loop.run_in_executor(None, ask, "example.com")
        assert other.header.rcode == 5 and other.rr == []  # REFUSED
    finally:
        protocol.close()


def test_a_lookup_teardown_removes_the_redirect_chain_and_its_jump() -> None:
    """Without the sandbox's network at hand (a crash lost it), its rules are found by tag in
    ``iptables-save``: the FORKYARD-PRE jump and the AEP- chain go with the rest."""
    saved = "\n".join(
        [
            "*nat",
            ":FORKYARD-PRE - [0:0]",
            ":AEP-aeh7 - [0:0]",
            ":AEP-aeh8 - [0:0]",
            "-A FORKYARD-PRE -i aeh7 -p tcp -m comment --comment ae-x1 -j AEP-aeh7",
            "-A AEP-aeh7 -p tcp -m multiport --dports 80,443 -j REDIRECT --to-ports 4000",
            "COMMIT",
            "*filter",
            ":AEO-aeh7 - [0:0]",
            "-A FORKYARD -i aeh7 -m comment --comment ae-x1 -j AEO-aeh7",
            "COMMIT",
        ]
    )
    deletes = network._tagged_deletes(saved, "ae-x1", set())
    assert deletes["nat"] == [
        "-D FORKYARD-PRE -i aeh7 -p tcp -m comment --comment ae-x1 -j AEP-aeh7",
        "-F AEP-aeh7",
        "-X AEP-aeh7",
    ]
    assert deletes["filter"] == [
        "-D FORKYARD -i aeh7 -m comment --comment ae-x1 -j AEO-aeh7",
        "-F AEO-aeh7",
        "-X AEO-aeh7",
    ]
    # A chain left without its jump (a teardown cut short) goes by the slot's egress chain name.
    assert network._tagged_deletes(saved, "ae-gone", {"AEO-aeh8"})["nat"] == ["-F AEP-aeh8", "-X AEP-aeh8"]
