"""The one error vocabulary of forkyard.

Every layer raises one of these kinds, never an HTTP status: the kind says what went wrong for
the caller (the thing is not there, it is in the wrong state, the request is wrong, ...). The
edges that answer over HTTP (the control-plane API and envd) turn a kind into E2B's error shape
``{"code": <status>, "message": <text>}`` with :func:`http_status`, in one place each.

Imports nothing of the project (envd's bundle ships it).
"""

from __future__ import annotations


class ForkyardError(Exception):
    """Base of the vocabulary; ``message`` is safe to show to an API client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Invalid(ForkyardError):
    """The request is malformed or asks for something impossible (400)."""


class Unauthenticated(ForkyardError):
    """No or a wrong API key / access token (401)."""


class Forbidden(ForkyardError):
    """Authenticated, but not allowed to do this (403)."""


class NotFound(ForkyardError):
    """The sandbox, snapshot, template, file or process does not exist (404)."""


class Conflict(ForkyardError):
    """The thing exists but is in a state that forbids the operation; retrying later may work (409)."""


class Gone(ForkyardError):
    """The thing existed and is lost: a sandbox that died, a snapshot whose files vanished (410)."""


class TooLarge(ForkyardError):
    """The request body or a file is over a limit (413)."""


class InsufficientStorage(ForkyardError):
    """The disk is full or over its quota (507; envd's uploads, the SDK's NotEnoughSpaceException)."""


class NotSupported(ForkyardError):
    """This node cannot do that at all (no such feature on this runtime) (501)."""


class Unavailable(ForkyardError):
    """A needed part is not usable right now: a runtime, envd, capacity (503)."""


class LimitReached(ForkyardError):
    """A count limit is reached, e.g. the node's most concurrent sandboxes (429, E2B's)."""


class Failed(ForkyardError):
    """An operation that should have worked failed; the message says which step and why (500)."""


_STATUS: dict[type[ForkyardError], int] = {
    Invalid: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    Gone: 410,
    TooLarge: 413,
    LimitReached: 429,
    Failed: 500,
    NotSupported: 501,
    Unavailable: 503,
    InsufficientStorage: 507,
}


def http_status(exc: ForkyardError) -> int:
    """The HTTP status E2B answers with for this kind of error."""
    for kind in type(exc).__mro__:
        status = _STATUS.get(kind)  # type: ignore[call-overload]
        if status is not None:
            return status
    return 500


def error_body(exc: ForkyardError) -> dict[str, object]:
    """E2B's error shape for ``exc``."""
    return {"code": http_status(exc), "message": exc.message}
