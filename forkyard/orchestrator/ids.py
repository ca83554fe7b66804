"""Identifiers in E2B's format: sandbox ids are 20 lowercase alphanumerics."""

from __future__ import annotations

import re
import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits
SANDBOX_ID_LENGTH = 20
SANDBOX_ID_RE = re.compile(r"[a-z0-9]{20}")
#: What the proxy and the API accept as a sandbox id (E2B's format, plus the ``-<client>`` suffix
#: older SDKs append, which is stripped before lookup).
SANDBOX_ID_LOOSE_RE = re.compile(r"[a-z0-9]{1,64}")


def new_sandbox_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(SANDBOX_ID_LENGTH))


def new_access_token() -> str:
    """A token envd requires in ``X-Access-Token`` (or the proxy in ``e2b-traffic-access-token``)."""
    return secrets.token_urlsafe(32)


def normalise_sandbox_id(raw: str) -> str:
    """E2B sandbox ids used to carry a ``-<clientID>`` suffix; both spellings mean the same sandbox."""
    return raw.split("-", 1)[0].lower()
