"""A streaming ``multipart/form-data`` reader: parts arrive as async byte streams, never buffered whole.

Starlette's form parser needs python-multipart and spools every file to /tmp first; uploads here go
straight to their destination instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from forkyard.errors import Invalid


class MultipartError(Invalid):
    """The body is not well-formed multipart/form-data (the client's fault: 400)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"invalid multipart body: {problem}")


@dataclass
class PartHeaders:
    name: str | None = None
    filename: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def boundary_from_content_type(content_type: str) -> bytes:
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value:
            return value.strip('"').encode("latin-1")
    raise MultipartError("multipart/form-data without a boundary")


def _parse_disposition(value: str) -> dict[str, str]:
    """Parameters of a Content-Disposition value; quoted strings may hold ``;`` and escaped quotes."""
    params: dict[str, str] = {}
    i, n = 0, len(value)
    while i < n:
        semi = value.find(";", i)
        if semi < 0:
            break
        i = semi + 1
        while i < n and value[i] == " ":
            i += 1
        eq = value.find("=", i)
        if eq < 0:
            break
        key = value[i:eq].strip().lower()
        i = eq + 1
        if i < n and value[i] == '"':
            i += 1
            chars: list[str] = []
            while i < n and value[i] != '"':
                if value[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(value[i])
                i += 1
            i += 1
            params[key] = "".join(chars)
        else:
            end = value.find(";", i)
            end = n if end < 0 else end
            params[key] = value[i:end].strip()
            i = end
    return params


class MultipartReader:
    """``async for headers, body in reader.parts()``; each ``body`` must be consumed before the next."""

    def __init__(self, chunks: AsyncIterator[bytes], boundary: bytes) -> None:
        self._chunks = chunks
        self._delimiter = b"\r\n--" + boundary
        self._buffer = bytearray(b"\r\n")  # lets the first boundary match like the others
        self._eof = False

    async def _fill(self) -> bool:
        if self._eof:
            return False
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            self._eof = True
            return False
        self._buffer += chunk
        return True

    async def _read_until(self, marker: bytes, limit: int) -> bytes:
        while (index := self._buffer.find(marker)) < 0:
            if len(self._buffer) > limit:
                raise MultipartError("multipart headers too large")
            if not await self._fill():
                raise MultipartError("multipart body ended early")
        data = bytes(self._buffer[:index])
        del self._buffer[: index + len(marker)]
        return data

    async def parts(self) -> AsyncIterator[tuple[PartHeaders, AsyncIterator[bytes]]]:
        await self._read_until(self._delimiter, 64 * 1024)  # preamble
        while True:
            while len(self._buffer) < 2:
                if not await self._fill():
                    raise MultipartError("multipart body ended early")
            if self._buffer[:2] == b"--":
                return  # closing delimiter
            raw_headers = await self._read_until(b"\r\n\r\n", 64 * 1024)
            headers = self._parse_headers(raw_headers)
            body = self._body()
            yield headers, body
            async for _ in body:  # skip whatever the consumer left
                pass

    @staticmethod
    def _parse_headers(raw: bytes) -> PartHeaders:
        part = PartHeaders()
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            key, sep, value = line.partition(":")
            if not sep:
                continue
            part.headers[key.strip().lower()] = value.strip()
        disposition = part.headers.get("content-disposition", "")
        params = _parse_disposition(disposition)
        part.name = params.get("name")
        part.filename = params.get("filename")
        return part

    async def _body(self) -> AsyncIterator[bytes]:
        keep = len(self._delimiter)
        while True:
            index = self._buffer.find(self._delimiter)
            if index >= 0:
                if index:
                    yield bytes(self._buffer[:index])
                del self._buffer[: index + len(self._delimiter)]
                return
            if len(self._buffer) > keep:
                # Everything but a possible delimiter prefix at the end is part data.
                cut = len(self._buffer) - keep
                yield bytes(self._buffer[:cut])
                del self._buffer[:cut]
            if not await self._fill():
                raise MultipartError("multipart body ended before its closing boundary")
