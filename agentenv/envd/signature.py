"""v1 file URL signatures (e2b/sandbox/signature.py): ``/files`` without X-Access-Token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from starlette.requests import Request


def expected_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def signature_grants(request: Request, token: str) -> bool:
    """True when the ``signature`` query parameter signs this path, operation and user."""
    params = request.query_params
    signature = params.get("signature")
    if not signature:
        return False
    expiration: int | None = None
    if params.get("signature_expiration"):
        try:
            expiration = int(params["signature_expiration"])
        except ValueError:
            return False
        if expiration < time.time():
            return False
    operation = "read" if request.method == "GET" else "write"
    wanted = expected_signature(
        params.get("path", ""), operation, params.get("username", ""), token, expiration
    )
    return hmac.compare_digest(signature.encode(), wanted.encode())
