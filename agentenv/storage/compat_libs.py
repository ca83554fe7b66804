"""Small preload libraries that paper over gaps of the sandbox kernel, shipped in the envd bundle.

``statx``: runsc 2022-12 (Debian 12's gVisor) answers EINVAL to ``statx(2)`` with
``AT_NO_AUTOMOUNT``, which coreutils' ``ls`` and ``stat`` always pass, so ``ls /tmp`` fails
inside every gVisor sandbox. A sandbox has no automount points, so the flag means nothing there:
the wrapper drops it and makes the system call itself. Processes that envd starts load it
through ``LD_PRELOAD`` (see the gVisor runtime); programs that call ``statx`` without the flag, or
use ``stat``/``fstatat`` (Python, Go), never notice it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

STATX_COMPAT = "agentenv-statx-compat.so"

_STATX_SOURCE = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
"""


def build_statx_compat(lib_dir: Path) -> Path | None:
    """Compile the statx wrapper into ``lib_dir``; None (logged) when no C compiler is here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning(
            "no C compiler: %s not built, `ls` fails in gVisor sandboxes on runsc 2022-12", STATX_COMPAT
        )
        return None
    source = lib_dir / "agentenv-statx-compat.c"
    target = lib_dir / STATX_COMPAT
    source.write_text(_STATX_SOURCE)
    try:
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-s", "-o", str(target), str(source)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s failed: %s", STATX_COMPAT, detail)
        return None
    finally:
        source.unlink(missing_ok=True)
    return target
