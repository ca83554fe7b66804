"""Sandbox network policy: the ``network`` of a create and ``PUT /sandboxes/{id}/network``.

E2B's semantics (openapi.yml ``SandboxNetworkConfig``, ``SandboxNetworkUpdateConfig``; its API's
``validateNetworkConfig``): ``allowOut``/``denyOut`` take IPv4 addresses and CIDR blocks, allow
beats deny, ``allow_internet_access=False`` is ``denyOut=["0.0.0.0/0"]``; an update replaces the
whole egress configuration (what it leaves out is cleared); ``allowPublicTraffic=False`` needs
a secure sandbox and makes every port but envd's require ``e2b-traffic-access-token``;
``maskRequestHost`` (``${PORT}`` expanded) is the Host the sandbox sees. Enforcement is
``forkyard.runtime.network`` (the sandbox's egress chain) and ``forkyard.api.proxy`` (ingress).

Domain names (and ``*.`` wildcards) in ``allowOut`` are E2B's: they need ``ALL_TRAFFIC`` in
``denyOut`` (or no internet access), are matched on TLS SNI (port 443) and HTTP Host (port 80) by
the node's egress proxy (``forkyard.runtime.egress_proxy``), and open the resolvers
(``dnsServers``, else the templates' own) on port 53. What this node cannot honour is refused
with a 400 naming it, never silently ignored: per-domain ``rules`` (request transforms),
``egressProxy`` (SOCKS5 tunnelling) and ``httpsPorts``.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from forkyard.api.auth import require_api_key
from forkyard.api.schemas import NetworkEgress, SandboxNetworkConfig, SandboxNetworkUpdateConfig
from forkyard.errors import Invalid
from forkyard.orchestrator.ids import normalise_sandbox_id
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.orchestrator.store import NetworkPolicy
from forkyard.runtime.egress_policy import parse_egress
from forkyard.types import EgressPolicy

router = APIRouter(dependencies=[Depends(require_api_key)])

#: ``host`` or ``host:port``; ``${PORT}`` anywhere stands for the port requested.
_MASK_RE = re.compile(r"^[A-Za-z0-9_.-]+(:[0-9]{1,5})?$")
_DNS_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


def orchestrator(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


Orch = Annotated[Orchestrator, Depends(orchestrator)]


def _refuse_unsupported(body: NetworkEgress) -> None:
    if body.rules:
        raise Invalid(
            "network.rules (per-domain request transforms) are not supported on this node: "
            "its egress proxy checks names, it does not rewrite requests"
        )
    if body.egress_proxy:
        raise Invalid("network.egressProxy (SOCKS5 tunnelling) is not supported on this node")
    for server in body.dns_servers or []:
        if not _DNS_RE.fullmatch(server):
            raise Invalid(f"invalid DNS server {server!r}: expected an IPv4 address")


def egress_of(body: NetworkEgress, *, internet_closed: bool = False) -> EgressPolicy:
    _refuse_unsupported(body)
    return parse_egress(
        body.allow_out, body.deny_out, dns_servers=body.dns_servers, internet_closed=internet_closed
    )


def check_mask(mask: str) -> str:
    """E2B's check: ``host[:port]`` in ASCII (``${PORT}`` allowed); also no header injection."""
    if not _MASK_RE.fullmatch(mask.replace("${PORT}", "1")):
        raise Invalid(f"mask request host is not valid: {mask}")
    return mask


def create_network(
    network: SandboxNetworkConfig | None, *, secure: bool, allow_internet_access: bool | None
) -> NetworkPolicy:
    """A create's network policy (``allowInternetAccess`` and ``network``), checked."""
    if network is None:
        return NetworkPolicy(allow_internet_access=allow_internet_access)
    if network.https_ports:
        raise Invalid("network.httpsPorts is not supported on this node (the proxy speaks HTTP to sandboxes)")
    egress = egress_of(network, internet_closed=allow_internet_access is False)
    if network.allow_public_traffic is False and not secure:
        raise Invalid(
            "You cannot create a sandbox without public access unless you enable secure envd "
            "access via 'secure' flag."
        )
    return NetworkPolicy(
        allow_internet_access=allow_internet_access,
        egress=egress if egress.allow_out or egress.deny_out else None,
        mask_request_host=check_mask(network.mask_request_host)
        if network.mask_request_host is not None
        else None,
        dns_servers=tuple(network.dns_servers) if network.dns_servers is not None else None,
    )


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: SandboxNetworkUpdateConfig, orch: Orch) -> Response:
    egress = egress_of(body, internet_closed=body.allow_internet_access is False)
    await orch.update_network(
        normalise_sandbox_id(sandbox_id),
        egress=egress,
        allow_internet_access=body.allow_internet_access,
        dns_servers=body.dns_servers,
    )
    return Response(status_code=204)
