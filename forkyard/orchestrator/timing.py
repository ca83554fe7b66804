"""Clock helpers shared by the orchestrator's modules."""

from __future__ import annotations

import datetime as dt
import time


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def elapsed_ms(start: float) -> int:
    """Milliseconds since ``start`` (a ``time.monotonic()`` reading)."""
    return round((time.monotonic() - start) * 1000)
