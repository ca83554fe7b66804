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


def signature_refusal(request: Request, token: str) -> str | None:
    """None when the ``signature`` query parameter signs this path, operation and user and has not
    expired; else why not, in E2B envd's words (auth.go ``validateSigning``: the signature is
    checked before its expiry)."""
    params = request.query_params
    signature = params.get("signature")
    if not signature:
        return "missing signature query parameter"
    expiration: int | None = None
    if params.get("signature_expiration"):
        try:
            expiration = int(params["signature_expiration"])
        except ValueError:
            return "invalid signature"
    operation = "read" if request.method == "GET" else "write"
    wanted = expected_signature(
        params.get("path", ""), operation, params.get("username", ""), token, expiration
    )
    if not hmac.compare_digest(signature.encode(), wanted.encode()):
        return "invalid signature"
    if expiration is not None and expiration < time.time():
        return "signature is already expired"
    return None
