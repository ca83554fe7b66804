"""What a test leaves in the event loop it shares with later tests (pytest-asyncio's session loop).

An fd closed while the loop still watches it is the harmful leftover: epoll drops a closed fd by
itself, but asyncio's selector keeps its key for the number. The next socket given that number
in the loop is then never watched, because adding a reader with the key's events only replaces
the callback (selectors' ``modify`` asks epoll nothing when the events are unchanged): a loopback
sandbox's listener never accepted, and all 20 envd ``/init`` attempts of a test far from the one
that closed the fd timed out (pyzmq sockets moved between two loops, tests/unit/test_interpreter.py).
"""

from __future__ import annotations

import asyncio
import select
from pathlib import Path


def drop_unwatched_fds(loop: asyncio.AbstractEventLoop) -> dict[int, str]:
    """The fds ``loop``'s selector has a key for that its epoll set does not hold, each with the
    key's callbacks; their keys are removed, so that the next socket given the number is watched
    again. Empty for a loop without an epoll selector (the check reads Linux's
    ``/proc/self/fdinfo`` of the epoll fd, which lists the fds it watches as ``tfd:`` lines)."""
    selector = getattr(loop, "_selector", None)  # a selector event loop's (private, no API for it)
    epoll = getattr(selector, "_selector", None)
    if selector is None or not isinstance(epoll, select.epoll) or epoll.closed:
        return {}
    fdinfo = Path(f"/proc/self/fdinfo/{epoll.fileno()}").read_text().splitlines()
    watched = {int(line.split()[1]) for line in fdinfo if line.startswith("tfd:")}
    unwatched = {fd: repr(key.data) for fd, key in selector.get_map().items() if fd not in watched}
    for fd in unwatched:
        selector.unregister(fd)  # epoll's unregister fails (ignored): the fd is not in its set
    return unwatched
