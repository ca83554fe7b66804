"""``forkyard gateway``: uvicorn serving the cluster's whole E2B API and envd traffic on one port."""

from __future__ import annotations

import logging
import sys

import uvicorn

from forkyard.api.node_role import require_cluster_settings
from forkyard.api.server import connection_help
from forkyard.config import Settings
from forkyard.gateway.app import create_gateway_app

log = logging.getLogger("forkyard.gateway")


def run(host: str | None = None, port: int | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    updates: dict[str, object] = {"role": "gateway"}
    if host:
        updates["host"] = host
    if port:
        updates["port"] = port
    settings = Settings().model_copy(update=updates)
    require_cluster_settings(settings, "forkyard gateway")
    app = create_gateway_app(settings)
    print(f"forkyard gateway listening on http://{settings.host}:{settings.port}", flush=True)
    print("Point the E2B SDKs here with:", flush=True)
    print(connection_help(settings), flush=True)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level="info", timeout_keep_alive=75, access_log=False
    )
