"""A sandbox's logs: the orchestrator's events plus the lines of its runtime log files (envd's
output), moved into the database so they outlive the sandbox's scratch directory."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from forkyard.orchestrator.store import LogLine, SandboxRecord, SandboxStore

log = logging.getLogger(__name__)

#: Runtime log files in ``{data_dir}/sandboxes/<id>/`` collected into the sandbox's logs.
RUNTIME_LOG_FILES = ("envd.log",)
LOG_READ_LIMIT = 1 << 20
#: Levels E2B's logs use; others are shown as ``info``.
LEVELS = ("debug", "info", "warn", "error")
#: Who wrote a line without a ``source`` field (the lifecycle's events).
DEFAULT_LOGGER = "orchestrator"


def log_record(line: LogLine, sandbox_id: str) -> str:
    """A log line as E2B's v1 logs API gives it: one JSON record per line with ``level``,
    ``logger`` (``orchestrator`` for lifecycle events, the runtime log file's name for its
    lines, e.g. ``envd``), ``message`` and the line's other fields. E2B's CLI
    (``e2b sandbox logs``) parses every line so and filters on ``level`` and ``logger``."""
    fields = {k: v for k, v in line.fields.items() if k not in ("level", "logger", "message")}
    record = {
        "level": line.level if line.level in LEVELS else "info",
        "logger": line.fields.get("source") or DEFAULT_LOGGER,
        "message": line.message,
        "sandboxID": sandbox_id,
        **fields,
    }
    return json.dumps(record, separators=(",", ":"))


class SandboxLogs:
    def __init__(self, store: SandboxStore, sandboxes_dir: Path) -> None:
        self._store = store
        self._sandboxes_dir = sandboxes_dir
        self._locks: dict[str, asyncio.Lock] = {}

    async def event(self, sandbox_id: str, level: str, message: str, **fields: str) -> None:
        try:
            await self._store.add_log(sandbox_id, level, message, **fields)
        except Exception:
            # A log line must never break the lifecycle transition it describes.
            log.exception("could not store a log line for %s", sandbox_id)

    async def collect(self, rec: SandboxRecord) -> None:
        """Move new lines of the sandbox's runtime log files into its logs. The read offsets are
        kept in the record so a restarted server does not collect the same lines twice."""
        async with self._locks.setdefault(rec.sandbox_id, asyncio.Lock()):
            fresh = await self._store.get(rec.sandbox_id)
            offsets = dict((fresh or rec).log_offsets)
            directory = self._sandboxes_dir / rec.sandbox_id
            changed = False
            for name in RUNTIME_LOG_FILES:
                start = offsets.get(name, 0)
                data = await asyncio.to_thread(_read_from, directory / name, start, LOG_READ_LIMIT)
                end = data.rfind(b"\n") + 1
                if end == 0:
                    continue
                lines = data[:end].decode(errors="replace").splitlines()
                source = name.removesuffix(".log")
                await self._store.add_logs(
                    rec.sandbox_id, [("info", ln, {"source": source}) for ln in lines if ln.strip()]
                )
                offsets[name] = start + end
                changed = True
            if changed:
                rec.log_offsets = offsets
                await self._store.set_log_offsets(rec.sandbox_id, offsets)

    def forget(self, sandbox_id: str) -> None:
        self._locks.pop(sandbox_id, None)


def _read_from(path: Path, offset: int, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(limit)
    except FileNotFoundError:
        return b""
