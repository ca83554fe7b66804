"""Starts uvicorn with the envd app."""

from __future__ import annotations

import uvicorn

from agentenv.envd.app import create_app
from agentenv.envd.settings import parse_settings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        http="h11",
        loop="asyncio",
        lifespan="on",
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=60,
        # Process and watch streams stay open indefinitely; don't let them hold a shutdown up.
        timeout_graceful_shutdown=3,
    )
