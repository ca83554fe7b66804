"""``forkyard serve``: uvicorn serving the control plane and the sandbox proxy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn

from forkyard.api import dns, tls
from forkyard.api.app import create_app
from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.runtime.kinds import select_runtime

log = logging.getLogger("forkyard.serve")


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


def run(host: str | None = None, port: int | None = None, role: str = "single") -> None:
    """Serve ``role``: ``single`` (``forkyard serve``) or ``node`` (``forkyard node serve``)."""
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
    if role != "single":
        updates["role"] = role
    if updates:
        settings = settings.model_copy(update=updates)
    if settings.role == "node":
        from forkyard.api.node_role import require_cluster_settings

        require_cluster_settings(settings, "forkyard node serve")

    runtime, reasons = select_runtime(settings)
    problem = runtime.probe()
    log.info("runtime: %s%s", runtime.name, f" (WARNING: {problem})" if problem else "")
    for name, why in sorted(reasons.items()):
        log.info("runtime %s not used: %s", name, why)
    log.info("data directory: %s; templates: %s", settings.data_dir, settings.templates_dir)

    # Bound before anything is printed: a port in use is a clear error, not a half-started node.
    tls_socket = _bind(settings.host, settings.tls_port) if settings.tls_port else None
    tls_files = tls.ensure_tls(settings) if tls_socket else None
    # What the API answers as ``domain``: with TLS ``sandbox.get_host(port)`` names the HTTPS listener.
    domain = tls.https_domain(settings) if tls_socket is not None else None
    app = create_app(settings, runtime=runtime, public_domain=domain)
    # Printed on stdout (logs go to stderr) so a script can capture exactly these lines.
    print(f"forkyard listening on http://{settings.host}:{settings.port}", flush=True)
    if settings.role == "node":
        print(f"cluster node {settings.node_name}: gateways reach it at {settings.node_address}", flush=True)
        asyncio.run(_serve(app, settings, tls_socket, tls_files))
        return
    print(f"API key: {settings.effective_api_keys()[0]}", flush=True)
    print("Point the E2B SDKs here with:", flush=True)
    print(connection_help(settings), flush=True)
    if tls_files is not None:
        print(sandbox_url_help(settings, tls_files), flush=True)
    asyncio.run(_serve(app, settings, tls_socket, tls_files))


def sandbox_url_help(settings: Settings, files: tls.TlsFiles) -> str:
    domain = tls.https_domain(settings)
    lines = [
        f"Sandbox URLs: https://<port>-<sandbox id>.{domain} (sandbox.get_host); trust the CA with:",
        f"export SSL_CERT_FILE={files.bundle}",
        f"export NODE_EXTRA_CA_CERTS={files.ca}",
    ]
    if not settings.dns_listen and not sandbox_names_resolve(settings.sandbox_domain):
        lines.append(
            f"WARNING: names under {settings.sandbox_domain} do not resolve on this host: for *.localhost "
            "install libnss-myhostname (Debian; `make run` does), else see README, 'Sandbox URLs'"
        )
    return "\n".join(lines)


def sandbox_names_resolve(sandbox_domain: str) -> bool:
    """A sandbox URL's host name resolves here (the host's resolver, as clients use it)."""
    try:
        return bool(socket.getaddrinfo(f"49983-probe.{sandbox_domain}", 443, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError):
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the
    # listener's proto says TCP. Without it every HTTPS response whose body follows its headers
    # in a second TLS record waited for the client's delayed ACK (40 ms, Nagle), as uvicorn's
    # own listener (which names the proto) never did.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Invalid(
            f"cannot listen for sandbox URLs on {host}:{port}: {exc.strerror or exc} "
            "(set FORKYARD_TLS_PORT to a free port, or 0 to turn sandbox URLs off)"
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Secondary(uvicorn.Server):
    """The HTTPS listener: the same app, no lifespan of its own and no signal handlers (the main
    server owns both; it stops this one when it stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _config(app: Any, settings: Settings, **extra: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        # The SDK keeps connections alive between calls; long idle streams are the norm.
        timeout_keep_alive=75,
        access_log=False,
        **extra,
    )


async def _serve(
    app: Any, settings: Settings, tls_socket: socket.socket | None, tls_files: tls.TlsFiles | None
) -> None:
    main = uvicorn.Server(_config(app, settings))
    if tls_socket is None or tls_files is None:
        await main.serve()
        return
    secure = _Secondary(
        _config(
            app, settings, lifespan="off", ssl_certfile=str(tls_files.cert), ssl_keyfile=str(tls_files.key)
        )
    )
    resolver = None
    if settings.dns_listen:
        address = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
        resolver, bound = await dns.start_dns(
            settings.dns_listen, settings.sandbox_domain, address, settings.dns_upstream
        )
        print(f"DNS for *.{settings.sandbox_domain} on {bound[0]}:{bound[1]}", flush=True)

    async def stop_with_main() -> None:
        # uvicorn's flags are plain attributes, set from its signal handler: polled.
        while not main.should_exit:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        secure.should_exit = True

    watcher = asyncio.ensure_future(stop_with_main())
    serving = asyncio.ensure_future(main.serve())
    try:
        # HTTPS opens once the main server's lifespan has started the orchestrator.
        while not main.started and not serving.done():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if main.started:
            await asyncio.gather(serving, secure.serve(sockets=[tls_socket]))
        else:
            await serving
    finally:
        watcher.cancel()
        if resolver is not None:
            resolver.close()
