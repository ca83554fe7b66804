"""API-key authentication: ``X-API-Key`` (what the SDKs send) or ``Authorization: Bearer``."""

from __future__ import annotations

import hmac

from fastapi import Request

from forkyard.errors import Unauthenticated


def presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def check_key(key: str | None, accepted: list[str]) -> bool:
    if not key:
        return False
    # Compare against every key in constant time, so timing says nothing about which matched.
    matches = [hmac.compare_digest(key.encode(), k.encode()) for k in accepted]
    return any(matches)


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 in E2B's shape unless a valid key is presented."""
    accepted: list[str] = request.app.state.api_keys
    key = presented_key(request)
    if key is None:
        raise Unauthenticated("missing API key: send it in the X-API-Key header")
    if not check_key(key, accepted):
        raise Unauthenticated("invalid API key")
