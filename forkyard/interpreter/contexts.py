"""Execution contexts: one kernel each, created on request or as a language's default.

The first request for a language without a context gets that language's default context (the
SDK's ``run_code(code, language=...)``); ``python``'s is started with the server, so the template's
snapshot holds it warm. Contexts are independent: their own kernel, working directory and state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import ENVD_PORT, ENVS_FILE
from .kernels import Kernel, kernel_env
from .languages import Language

logger = logging.getLogger("forkyard.interpreter")

#: envd's answer is local: a slow one means envd is busy, and the cell runs without new variables.
ENVD_TIMEOUT_S = 2.0


class ContextNotFound(LookupError):
    pass


@dataclass
class Context:
    id: str
    language: Language
    cwd: str
    kernel: Kernel

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "language": self.language.name, "cwd": self.cwd}


class Contexts:
    def __init__(self, home: str) -> None:
        self.home = home
        self.by_id: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self._default_locks: dict[str, asyncio.Lock] = {}

    async def create(self, language: Language, cwd: str | None) -> Context:
        cwd = cwd or self.home
        context = Context(str(uuid.uuid4()), language, cwd, Kernel(language, cwd, kernel_env(self.home)))
        await context.kernel.start()
        self.by_id[context.id] = context
        logger.info("context %s (%s, %s) started", context.id, language.name, context.cwd)
        return context

    async def default(self, language: Language) -> Context:
        lock = self._default_locks.setdefault(language.name, asyncio.Lock())
        async with lock:  # two first requests start one kernel, not two
            context_id = self.defaults.get(language.name)
            if context_id in self.by_id:
                return self.by_id[context_id]
            context = await self.create(language, None)
            self.defaults[language.name] = context.id
            return context

    def get(self, context_id: str) -> Context:
        try:
            return self.by_id[context_id]
        except KeyError:
            raise ContextNotFound(f"context {context_id!r} not found") from None

    async def delete(self, context_id: str) -> None:
        context = self.get(context_id)
        del self.by_id[context_id]
        await context.kernel.shutdown()

    async def restart(self, context_id: str) -> None:
        context = self.get(context_id)
        async with context.kernel.lock:
            await context.kernel.restart()

    async def close(self) -> None:
        for context in list(self.by_id.values()):
            await context.kernel.shutdown()
        self.by_id.clear()


class SandboxEnvs:
    """The sandbox's variables (the create's, a resume's or a fork's), for every cell.

    envd keeps them in ``ENVS_FILE`` and rewrites it (a new inode) whenever ``/init`` changes them:
    a cell costs one ``stat``, and the file is read again only when it changed, e.g. in a sandbox
    restored from the template's snapshot or forked. Where envd keeps no file (a microVM runtime,
    an older envd) they are asked from envd's ``/envs`` per cell; {} when envd does not answer
    (outside a sandbox, in tests)."""

    def __init__(self, path: str = ENVS_FILE) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._envs: dict[str, str] = {}

    async def current(self) -> dict[str, str]:
        try:
            stat = os.stat(self.path)
        except OSError:
            return await envd_envs()
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            try:
                # A few bytes, read only when envd rewrote them: no thread hop for this.
                envs = json.loads(Path(self.path).read_bytes())  # noqa: ASYNC240
            except (OSError, ValueError):
                return await envd_envs()
            self._envs = _strings(envs)
            self._seen = seen
        return self._envs


def _strings(envs: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in envs.items()} if isinstance(envs, dict) else {}


async def envd_envs() -> dict[str, str]:
    """The sandbox's variables as envd's ``/envs`` (open to loopback) answers now."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", ENVD_PORT), ENVD_TIMEOUT_S
        )
    except (OSError, TimeoutError):
        return {}
    try:
        writer.write(b"GET /envs HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), ENVD_TIMEOUT_S)
    except (OSError, TimeoutError):
        return {}
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        logger.warning("envd's /envs answered %r", head.split(b"\r\n", 1)[0])
        return {}
    try:
        return _strings(json.loads(body))
    except ValueError:
        return {}
