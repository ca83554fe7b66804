"""``agentenv serve``: uvicorn serving the control plane and the sandbox proxy."""

from __future__ import annotations

import logging
import sys

import uvicorn

from agentenv.api.app import create_app
from agentenv.config import Settings
from agentenv.runtime.registry import select_runtime

log = logging.getLogger("agentenv.serve")


def connection_help(settings: Settings) -> str:
    """The lines a user pastes to point the official SDKs at this node."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = f"http://{host}:{settings.port}"
    key = settings.effective_api_keys()[0]
    return "\n".join(
        [
            f"export E2B_API_URL={base}",
            f"export E2B_SANDBOX_URL={base}",
            f"export E2B_API_KEY={key}",
        ]
    )


def run(host: str | None = None, port: int | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = Settings()
    updates: dict[str, object] = {}
    if host:
        updates["host"] = host
    if port:
        updates["port"] = port
    if updates:
        settings = settings.model_copy(update=updates)

    runtime, reasons = select_runtime(settings)
    problem = runtime.probe()
    log.info("runtime: %s%s", runtime.name, f" (WARNING: {problem})" if problem else "")
    for name, why in sorted(reasons.items()):
        log.info("runtime %s not used: %s", name, why)
    log.info("data directory: %s; templates: %s", settings.data_dir, settings.templates_dir)

    app = create_app(settings, runtime=runtime)
    # Printed on stdout (logs go to stderr) so a script can capture exactly these lines.
    print(f"agentenv listening on http://{settings.host}:{settings.port}", flush=True)
    print(f"API key: {settings.effective_api_keys()[0]}", flush=True)
    print("Point the E2B SDKs here with:", flush=True)
    print(connection_help(settings), flush=True)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        # The SDK keeps connections alive between calls; long idle streams are the norm.
        timeout_keep_alive=75,
        access_log=False,
    )
