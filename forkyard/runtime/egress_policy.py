"""E2B's outbound policy (``network.allowOut``/``denyOut``, ``allow_internet_access``) parsed into
an :class:`~forkyard.types.EgressPolicy`: what a create or ``PUT /sandboxes/{id}/network`` asks
for, checked. Enforcing it (iptables chains per sandbox) is :mod:`forkyard.runtime.network`'s;
domain rules are matched by :mod:`forkyard.runtime.egress_proxy`."""

from __future__ import annotations

import ipaddress

from forkyard.errors import Invalid
from forkyard.runtime import egress_proxy
from forkyard.types import EgressPolicy

#: Resolvers a sandbox with domain rules may query when the request names none: those of the
#: templates' /etc/resolv.conf (forkyard/storage/templates.py); E2B opens 8.8.8.8.
DEFAULT_RESOLVERS = ("1.1.1.1", "8.8.8.8")
#: E2B's message when ``allowOut`` names domains and ``denyOut`` lacks ``0.0.0.0/0``.
DOMAINS_NEED_BLOCK_ALL = (
    "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out "
    "to block all other traffic."
)
#: ``allowOut``/``denyOut`` entries per list (each is one rule every new connection walks).
MAX_POLICY_ENTRIES = 256


def _network_of(entry: object, field: str) -> str:
    """``entry`` (an IPv4 address or CIDR block, host bits allowed as in E2B) as ``a.b.c.d/n``;
    in ``allowOut`` a domain rule (``example.com``, ``*.example.com``, ``*``) comes back as
    ``domain:<rule>``."""
    if not isinstance(entry, str) or not entry.strip():
        raise Invalid(f"invalid {field} entry {entry!r}: expected an IPv4 address or CIDR block")
    text = entry.strip()
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        if field == "denyOut":
            raise Invalid(f"invalid denied CIDR {text}") from None
        rule = egress_proxy.normalise_rule(text)
        if rule is not None:
            return "domain:" + rule
        raise Invalid(
            f"invalid allowOut entry {text!r}: expected an IPv4 address, CIDR block or domain name"
        ) from None
    if net.version != 4:
        raise Invalid(f"invalid {field} entry {text}: sandboxes have IPv4 only")
    return str(net)


def parse_egress(
    allow_out: list[str] | None,
    deny_out: list[str] | None,
    *,
    dns_servers: list[str] | None = None,
    internet_closed: bool = False,
) -> EgressPolicy:
    """E2B's ``allowOut``/``denyOut`` as a policy; :class:`Invalid` names the first bad entry.

    Domain rules need every other destination closed (E2B: ``ALL_TRAFFIC`` in ``denyOut``; here
    ``allow_internet_access=False``, ``internet_closed``, says the same) and open the resolvers
    (``dns_servers``, else :data:`DEFAULT_RESOLVERS`) on port 53 so that names resolve."""
    lists = {"allowOut": allow_out or [], "denyOut": deny_out or []}
    for field, entries in lists.items():
        if len(entries) > MAX_POLICY_ENTRIES:
            raise Invalid(f"{field} has {len(entries)} entries; at most {MAX_POLICY_ENTRIES} are allowed")
    allowed = list(dict.fromkeys(_network_of(e, "allowOut") for e in lists["allowOut"]))
    denied = tuple(dict.fromkeys(_network_of(e, "denyOut") for e in lists["denyOut"]))
    domains = tuple(a.removeprefix("domain:") for a in allowed if a.startswith("domain:"))
    if domains and "0.0.0.0/0" not in denied and not internet_closed:
        raise Invalid(DOMAINS_NEED_BLOCK_ALL)
    resolvers = tuple(dns_servers or DEFAULT_RESOLVERS) if domains else ()
    return EgressPolicy(
        allow_out=tuple(a for a in allowed if not a.startswith("domain:")),
        deny_out=denied,
        allow_domains=domains,
        resolvers=tuple(dict.fromkeys(resolvers)),
    )
