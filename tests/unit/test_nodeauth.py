"""Gateway -> node signatures (forkyard/api/nodeauth.py): what verifies, what is refused, and
the node-role middleware in front of a real ASGI app."""

from __future__ import annotations

import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from forkyard.api import nodeauth
from forkyard.config import Settings
from forkyard.errors import Unauthenticated

SECRET = "s3cret-one"
OTHER = "s3cret-two"


def test_a_signature_verifies_under_any_listed_secret() -> None:
    digest = nodeauth.body_hash(b'{"templateID":"base"}')
    header = nodeauth.sign(SECRET, "POST", "/sandboxes?x=1", digest)
    nodeauth.verify([SECRET], header, "POST", "/sandboxes?x=1", digest)
    nodeauth.verify([OTHER, SECRET], header, "post", "/sandboxes?x=1", digest)  # rotation


@pytest.mark.parametrize(
    ("method", "target", "body", "why"),
    [
        ("GET", "/sandboxes?x=1", b'{"templateID":"base"}', "method"),
        ("POST", "/sandboxes?x=2", b'{"templateID":"base"}', "query"),
        ("POST", "/v2/sandboxes?x=1", b'{"templateID":"base"}', "path"),
        ("POST", "/sandboxes?x=1", b'{"templateID":"evil"}', "body"),
    ],
)
def test_any_change_breaks_the_signature(method: str, target: str, body: bytes, why: str) -> None:
    header = nodeauth.sign(SECRET, "POST", "/sandboxes?x=1", nodeauth.body_hash(b'{"templateID":"base"}'))
    with pytest.raises(Unauthenticated, match="invalid gateway signature"):
        nodeauth.verify([SECRET], header, method, target, nodeauth.body_hash(body))


def test_wrong_secret_missing_malformed_and_stale_are_refused() -> None:
    digest = nodeauth.body_hash(b"")
    with pytest.raises(Unauthenticated, match="invalid"):
        nodeauth.verify([OTHER], nodeauth.sign(SECRET, "GET", "/x", digest), "GET", "/x", digest)
    with pytest.raises(Unauthenticated, match="signed by a gateway"):
        nodeauth.verify([SECRET], None, "GET", "/x", digest)
    with pytest.raises(Unauthenticated, match="malformed"):
        nodeauth.verify([SECRET], "t=1,s=nothex", "GET", "/x", digest)
    old = nodeauth.sign(SECRET, "GET", "/x", digest, now=time.time() - 120)
    with pytest.raises(Unauthenticated, match="stale"):
        nodeauth.verify([SECRET], old, "GET", "/x", digest)
    future = nodeauth.sign(SECRET, "GET", "/x", digest, now=time.time() + 120)
    with pytest.raises(Unauthenticated, match="stale"):
        nodeauth.verify([SECRET], future, "GET", "/x", digest)
    nodeauth.verify(
        [SECRET], nodeauth.sign(SECRET, "GET", "/x", digest, now=time.time() - 30), "GET", "/x", digest
    )


async def _echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"body": body.decode(), "gateway": request.scope["state"].get(nodeauth.SIGNED_BY)})


def _node_client() -> httpx.AsyncClient:
    inner = Starlette(
        routes=[
            Route("/sandboxes", _echo, methods=["POST", "GET"]),
            Route("/health", lambda _: Response(status_code=204)),
            Route("/files", _echo, methods=["POST"]),
        ]
    )
    app = nodeauth.NodeAuth(inner, Settings(node_secrets=[SECRET]))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")


async def test_the_node_middleware_accepts_signed_requests_only() -> None:
    body = b'{"templateID":"base"}'
    async with _node_client() as client:
        unsigned = await client.post("/sandboxes", content=body, headers={"X-API-Key": "whatever"})
        assert unsigned.status_code == 401
        assert unsigned.json()["code"] == 401 and "gateway" in unsigned.json()["message"]

        headers = nodeauth.signed_headers([SECRET], "gw-1", "POST", "/sandboxes", nodeauth.body_hash(body))
        signed = await client.post("/sandboxes", content=body, headers=headers)
        assert signed.status_code == 200, signed.text
        assert signed.json() == {"body": body.decode(), "gateway": "gw-1"}  # the body reached the route

        swapped = await client.post("/sandboxes", content=b'{"templateID":"evil"}', headers=headers)
        assert swapped.status_code == 401

        assert (await client.get("/health")).status_code == 204  # probes need no signature


async def test_sandbox_traffic_is_signed_without_its_body() -> None:
    """envd traffic is streamed by the gateway: its body hash is UNSIGNED-PAYLOAD, and only
    requests routed to a sandbox may use it."""
    routed = {"E2B-Sandbox-Id": "abc123", "E2B-Sandbox-Port": "49983"}
    async with _node_client() as client:
        headers = nodeauth.signed_headers([SECRET], "gw", "POST", "/files", nodeauth.UNSIGNED_PAYLOAD)
        ok = await client.post("/files", content=b"any bytes", headers={**headers, **routed})
        # Routed to a sandbox (none runs behind this test app: it answers, the signature passed).
        assert ok.status_code == 200, ok.text
        not_routed = await client.post("/files", content=b"any bytes", headers=headers)
        assert not_routed.status_code == 401
