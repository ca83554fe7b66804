"""Execution contexts: one kernel each, created on request or as a language's default.

The first request for a language without a context gets that language's default context (the
SDK's ``run_code(code, language=...)``); ``python``'s is started with the server, so the template's
snapshot holds it warm. Contexts are independent: their own kernel, working directory and state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from . import ENVD_PORT
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


async def sandbox_envs() -> dict[str, str]:
    """The sandbox's variables as envd holds them (``/envs``, open to loopback): the create's, a
    resume's or a fork's. {} when envd does not answer (outside a sandbox, in tests)."""
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
        envs = json.loads(body)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in envs.items()} if isinstance(envs, dict) else {}
