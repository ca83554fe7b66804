"""The console's log-in: the API key, presented once in a form, kept in an HttpOnly cookie.

The cookie is ``SameSite=Strict`` and scoped to ``/console``: other sites cannot make the browser
send it (the console's actions are POST forms), and the E2B API itself keeps accepting only the
``X-API-Key`` / ``Authorization`` headers. A request that presents the key in a header is let in too
(scripts, curl).
"""

from __future__ import annotations

from fastapi import Request

from forkyard.api.auth import check_key, presented_key
from forkyard.errors import Unauthenticated

COOKIE = "forkyard_console_key"
COOKIE_PATH = "/console"


class LoginRequired(Unauthenticated):
    """No valid key: pages redirect to the log-in form, actions answer 401 in E2B's shape."""


def console_key(request: Request) -> str | None:
    return presented_key(request) or request.cookies.get(COOKIE)


async def require_console_key(request: Request) -> None:
    accepted: list[str] = request.app.state.api_keys
    key = console_key(request)
    if key is None:
        raise LoginRequired("log in with an API key")
    if not check_key(key, accepted):
        raise LoginRequired("invalid API key")
