"""Keeping envd out of reach of what runs in its sandbox (issue 15, item 7).

Root in a sandbox that ``PTRACE_ATTACH``-es envd stops it (the attach sends SIGSTOP), and once
the tracer exits without detaching properly envd stays stopped: no command, file or /health
answer any more (reproduced under gVisor: tests/system/test_envd_permissions.py). Two things keep
a sandbox's processes from attaching to envd or reading its memory (``/proc/<pid>/mem``,
``environ``, which hold the access token):

* envd is not dumpable (``PR_SET_DUMPABLE`` 0): only a tracer with CAP_SYS_PTRACE may attach
  to it or open its /proc files that need ptrace access (ptrace(2), "Ptrace access mode
  checking").
* CAP_SYS_PTRACE leaves envd's capability bounding set, so no process envd starts, root's
  included, can get it back: root still traces its own processes (same uid, dumpable, no
  capability it lacks), but not envd and not other users' processes.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("forkyard.envd")

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
CAP_SYS_PTRACE = 19


_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _prctl(option: int, arg: int) -> int:
    zero = ctypes.c_ulong(0)
    result: int = _libc().prctl(ctypes.c_int(option), ctypes.c_ulong(arg), zero, zero, zero)
    return _check(result, f"prctl({option}, {arg})")


def _drop_capability(cap: int) -> None:
    """Out of this thread's bounding set and its effective, permitted and inheritable sets: a
    bounding set alone is not enough, root's children get back what is inheritable."""
    if _prctl(PR_CAPBSET_READ, cap) == 1:
        _prctl(PR_CAPBSET_DROP, cap)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    libc = _libc()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    word, bit = divmod(cap, 32)
    mask = ctypes.c_uint32(~(1 << bit)).value
    data[word].effective &= mask
    data[word].permitted &= mask
    data[word].inheritable &= mask
    _check(libc.capset(ctypes.byref(header), data), "capset")


def protect_from_tracing() -> None:
    """At envd's start, before it has threads (capabilities are per thread; threads and
    processes started later inherit them). Best effort: envd still starts where the kernel
    refuses (logged)."""
    try:
        _prctl(PR_SET_DUMPABLE, 0)
    except OSError as exc:
        logger.warning("envd stays dumpable (ptrace-attachable by its sandbox): %s", exc)
    try:
        _drop_capability(CAP_SYS_PTRACE)
    except OSError as exc:
        # Not root, or no CAP_SETPCAP: envd's processes keep what envd has.
        logger.info("CAP_SYS_PTRACE stays with envd's processes: %s", exc)
