"""A minimal asyncio QMP (QEMU Machine Protocol) client over the VM's Unix socket."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from forkyard.errors import Failed


class QmpError(Failed):
    """QEMU refused a command, or its QMP socket did not answer."""


class Qmp:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, socket_path: Path, limit_s: float = 10.0) -> Qmp:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(socket_path), limit=1 << 24)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() > deadline:
                    raise QmpError(f"QMP socket {socket_path} did not answer: {exc}") from exc
                await asyncio.sleep(0.02)
        qmp = cls(reader, writer)
        await qmp._read_message()  # greeting
        await qmp.execute("qmp_capabilities")
        return qmp

    async def _read_message(self) -> dict[str, Any]:
        line = await self._reader.readline()
        if not line:
            raise QmpError("QMP connection closed by QEMU")
        message: dict[str, Any] = json.loads(line)
        return message

    async def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        request: dict[str, Any] = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        self._writer.write(json.dumps(request).encode() + b"\n")
        await self._writer.drain()
        while True:
            message = await self._read_message()
            if "event" in message:  # asynchronous events are not needed by callers
                continue
            if "error" in message:
                err = message["error"]
                raise QmpError(f"QMP {command} failed: {err.get('class')}: {err.get('desc')}")
            return message.get("return")

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, BrokenPipeError):
            pass
