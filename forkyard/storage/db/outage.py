"""The database out of reach (a PostgreSQL restart, a network cut): how it is told apart
from other database errors, retried where that is safe, and answered as E2B's 503 otherwise.

A lost connection shows in three shapes with asyncpg under SQLAlchemy: a ``DBAPIError`` whose
connection SQLAlchemy invalidated (the server closed it mid-statement: "terminating connection due
to administrator command"); a bare ``OSError`` or timeout from ``connect`` (nothing listens); and
asyncpg's own connection errors from ``connect`` (57P03 "the database system is starting up" and
its neighbours), which SQLAlchemy does not wrap. Anything else (a constraint, a bad statement) is a
bug or a conflict and passes unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from forkyard.errors import ForkyardError, InsufficientStorage, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Pauses between attempts of an operation that is safe to repeat: the first retry gets a fresh
#: connection (a restart closed the pooled ones), the later ones ride out a short restart. About
#: 2 s in all, so that a request never waits long on a registry that is down: it answers 503.
RETRY_PAUSES_S = (0.1, 0.4, 1.5)
#: SQLSTATE classes of a connection that is gone or refused: 08 (connection exception) and the
#: shutdown/start-up members of 57 (operator intervention).
_LOST_SQLSTATES = ("08", "57P01", "57P02", "57P03")
UNAVAILABLE_MESSAGE = "the database is unreachable (connection lost); try again shortly"


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the database connection is gone or refused."""
    if isinstance(exc, ForkyardError):
        return False  # already answered (an Unavailable made of a lost commit is not repeated)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_lost(current):
            return True
        orig = current.orig if isinstance(current, DBAPIError) else None
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


def _is_lost(exc: BaseException) -> bool:
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, OSError | TimeoutError):
        return True
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(_LOST_SQLSTATES):
        return True
    # asyncpg's errors that carry no SQLSTATE of the server: the client side saw the socket go.
    return type(exc).__name__ in ("ConnectionDoesNotExistError", "InternalClientError") and (
        type(exc).__module__.startswith("asyncpg")
    )


def disk_full(exc: BaseException) -> bool:
    """Whether the database refused a write for want of disk: SQLite's SQLITE_FULL ("database or
    disk is full"), PostgreSQL's 53100 ``disk_full``."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if getattr(orig, "sqlstate", None) == "53100":
        return True
    return "database or disk is full" in str(orig)


def unavailable(exc: BaseException, what: str = "") -> Unavailable:
    """The 503 a lost connection is answered with."""
    message = f"{what}: {UNAVAILABLE_MESSAGE}" if what else UNAVAILABLE_MESSAGE
    return Unavailable(message)


@contextlib.contextmanager
def full_disk_as_507() -> Iterator[None]:
    """A write the database refused for want of disk is E2B's 507, not a 500."""
    try:
        yield
    except ForkyardError:
        raise
    except Exception as exc:
        if disk_full(exc):
            raise InsufficientStorage(f"the registry's disk is full: {exc}") from exc
        raise


async def reconnecting(op: Callable[[], Awaitable[T]], what: str = "") -> T:
    """Run ``op`` (which must be safe to repeat: a read, or a write that did not reach its
    commit), again after a short pause each time it loses its connection; :class:`Unavailable`
    when the database stays out of reach. Other errors pass at once."""
    for pause in (*RETRY_PAUSES_S, None):
        try:
            return await op()
        except Exception as exc:
            if not connection_lost(exc):
                raise
            if pause is None:
                log.warning("registry unreachable%s: %s", f" ({what})" if what else "", exc)
                raise unavailable(exc, what) from exc
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")  # the loop returns or raises
