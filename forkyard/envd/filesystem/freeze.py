"""``POST /fsfreeze`` and ``/fsthaw`` (envd.yaml): the root file system made consistent on disk
before a filesystem-only pause, whose processes are then killed without warning.

``sync`` first (under gVisor it flushes the sentry's caches to the gofer, hence to the host
upper layer the pause keeps), then FIFREEZE on ``/`` where the kernel has it; gVisor and overlay
roots answer EOPNOTSUPP/ENOTTY/EINVAL, and the sync is what remains (nothing writes after it
but processes about to die).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os

from starlette.requests import Request
from starlette.responses import Response

from forkyard.errors import Failed

FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS)


def _ioctl_root(request: int) -> None:
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, request)
    except OSError as exc:
        # EBUSY: frozen already (freeze) / EINVAL: not frozen (thaw): both idempotent successes.
        if exc.errno not in (*_UNSUPPORTED, errno.EBUSY):
            raise Failed(
                f"{'freezing' if request == FIFREEZE else 'thawing'} the root failed: {exc}"
            ) from exc
    finally:
        os.close(fd)


def _freeze() -> None:
    os.sync()
    _ioctl_root(FIFREEZE)


async def fsfreeze(request: Request) -> Response:
    await asyncio.to_thread(_freeze)
    return Response(status_code=204)


async def fsthaw(request: Request) -> Response:
    await asyncio.to_thread(_ioctl_root, FITHAW)
    return Response(status_code=204)
