"""Where the proxy sends each reachable sandbox's traffic, and who hears when one stops being
reachable (kill, pause, death, snapshot): the API's proxy subscribes to end its open streams.

Like e2b-dev/infra's sandbox map, the table notifies subscribers of removals; the lifecycle
owner only adds and removes routes at its transitions."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """Where the proxy sends a sandbox's traffic."""

    sandbox_id: str
    address: str
    envd_url: str
    traffic_access_token: str | None
    #: ``network.maskRequestHost``: the Host the sandbox sees (``${PORT}`` expanded by the proxy).
    mask_request_host: str | None = None
    #: envd's token (secure sandboxes): a signed file URL without routing headers is routed to
    #: the sandbox whose token signs it (the SDK's ``download_url`` with ``E2B_SANDBOX_URL``).
    envd_access_token: str | None = None


class RouteTable:
    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._on_remove: list[Callable[[str], None]] = []

    def subscribe(self, on_remove: Callable[[str], None]) -> None:
        """Have ``on_remove(sandbox_id)`` called whenever a sandbox stops being reachable."""
        self._on_remove.append(on_remove)

    def add(self, route: Route) -> None:
        self._routes[route.sandbox_id] = route

    def remove(self, sandbox_id: str) -> None:
        """The sandbox is no longer reachable; subscribers hear of it even when it had no
        route (a half-made sandbox may have had streams opened by a racing client)."""
        self._routes.pop(sandbox_id, None)
        for listener in self._on_remove:
            try:
                listener(sandbox_id)
            except Exception:
                log.exception("route removal listener failed for %s", sandbox_id)

    def get(self, sandbox_id: str) -> Route | None:
        return self._routes.get(sandbox_id)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._routes

    def all(self) -> list[Route]:
        return list(self._routes.values())

    def ids(self) -> list[str]:
        return list(self._routes)
