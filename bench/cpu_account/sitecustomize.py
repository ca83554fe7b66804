"""CPU accounting of a ``forkyard serve`` process and of every process it starts, for the per-child
CPU budget (``bench/fork_cpu.py``). Loaded by Python at start-up when this directory is on
``PYTHONPATH``; inert unless ``FORKYARD_BENCH_CPU_ACCOUNT`` names the file to write.

Every process the server starts goes through ``subprocess.Popen`` (asyncio's subprocesses too),
and every one is reaped through ``os.waitpid``; the patch records each start's command and reaps
with ``wait4`` instead, whose ``rusage`` is the CPU of the process and of the descendants it waited
for. ``SIGUSR2`` writes the totals (per kind of command: processes started, CPU seconds of those
reaped; the server's own CPU) as JSON to the file. Nothing of the server's behaviour changes.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import threading
from typing import Any

_OUT = os.environ.get("FORKYARD_BENCH_CPU_ACCOUNT", "")
#: runsc verbs, to name a runsc command by what it does (its global flags come first).
_RUNSC_VERBS = ("run", "restore", "checkpoint", "state", "list", "exec", "kill", "delete", "pause", "resume")


def _kind(args: Any) -> str:
    argv = [str(a) for a in args] if isinstance(args, list | tuple) else str(args).split()
    names = [os.path.basename(a) for a in argv]
    if "runsc" in names:
        verb = next((a for a in argv[names.index("runsc") + 1 :] if a in _RUNSC_VERBS), "?")
        return f"runsc {verb}"
    first = names[0] if names else "?"
    return first


def _install() -> None:
    lock = threading.Lock()
    started: dict[int, str] = {}
    totals: dict[str, list[float]] = {}  # kind -> [started, reaped, cpu seconds]
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    waitpid = os.waitpid

    def recording_execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any) -> None:
        execute_child(self, args, *rest)
        kind = _kind(args)
        with lock:
            started[self.pid] = kind
            totals.setdefault(kind, [0, 0, 0.0])[0] += 1

    def accounting_waitpid(pid: int, options: int) -> tuple[int, int]:
        if pid <= 0:
            return waitpid(pid, options)
        got, status, usage = os.wait4(pid, options)
        if got:
            with lock:
                kind = started.pop(got, "unrecorded")
                entry = totals.setdefault(kind, [0, 0, 0.0])
                entry[1] += 1
                entry[2] += usage.ru_utime + usage.ru_stime
        return got, status

    def dump(signum: int, frame: object) -> None:
        me = resource.getrusage(resource.RUSAGE_SELF)
        payload = {
            "server_cpu_s": me.ru_utime + me.ru_stime,
            "children": {k: {"started": v[0], "reaped": v[1], "cpu_s": v[2]} for k, v in totals.items()},
        }
        tmp = f"{_OUT}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, _OUT)

    profile_path = os.environ.get("FORKYARD_BENCH_CPU_PROFILE", "")
    profiler: list[Any] = []

    def toggle_profile(signum: int, frame: object) -> None:
        """SIGUSR1: start a cProfile of the main thread (the event loop), or stop it and write it."""
        import cProfile

        if profiler:
            done = profiler.pop()
            done.disable()
            done.dump_stats(profile_path)
            return
        profiler.append(cProfile.Profile())
        profiler[0].enable()

    if profile_path:
        signal.signal(signal.SIGUSR1, toggle_profile)
    subprocess.Popen._execute_child = recording_execute_child  # type: ignore[attr-defined]
    os.waitpid = accounting_waitpid
    signal.signal(signal.SIGUSR2, dump)


if _OUT:
    _install()
