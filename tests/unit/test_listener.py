"""The HTTPS listener's sockets: accepted connections send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from forkyard.api.server import _bind


def test_connections_the_https_listener_accepts_have_nagle_off() -> None:
    """asyncio turns Nagle off only on sockets whose listener says TCP as its proto. With Nagle
    on, an HTTPS response whose body followed its headers in a second TLS record waited for the
    client's delayed ACK: 40 ms on every envd call through sandbox URLs (16 -> 48 ms for a
    ``files.read``)."""

    async def scenario() -> int:
        listener = _bind("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        try:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(accepted, 5)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(scenario()) != 0
