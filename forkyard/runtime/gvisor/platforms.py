"""The runsc platform that ``settings.gvisor.platform = "auto"`` picks: the one this machine runs
sandboxes fastest on, by measurement.

gVisor intercepts the system calls of sandboxed processes through its *platform*: ``ptrace`` (a
ptrace stop per system call), ``systrap`` (seccomp traps served by stub threads, runsc's default
since 2023) or ``kvm`` (only with VT-x/AMD-V; on a /dev/kvm without them runsc hangs). Which one
is fastest depends on the host kernel and CPU, so each candidate runs one small container here
and we time what a sandbox's life costs: a ``runsc run`` (a cold create), commands (an HTTP
request to a server inside that starts ``sh -c "/bin/true; echo hi"`` with its output captured and
answers with it: envd's path for every ``commands.run``, and a process the command starts itself,
as nearly every real one does), a checkpoint and a restore (pause, snapshot,
every create from a template snapshot). :data:`WEIGHTS` says how many of each one sandbox's life
is taken to have; the smallest weighted sum wins. The measurement costs a few seconds, once per
runsc binary, kernel and :data:`PROBE_VERSION`: the result is kept in :data:`CACHE_FILE` under that
key.

Why commands weigh most: on a 2-core PVM machine (kernel 6.18) systrap restored faster (115 vs
165 ms) and started bare processes slower (12.5 vs 6.8 ms), and a probe that weighed 20 process
starts against one run and two restores picked it; ``commands.run("echo hi")`` through envd then
took 74-80 ms p50 against ptrace's 19-23 ms (docs/LATENCY.md). Restores mostly run ahead of demand
(warm pools, standbys), off the caller's path; an agent's episode runs tens of commands.

Why the command starts a process of its own (probe 3): a command that only starts ``sh`` from
the server cost about the same on both platforms here (ptrace 14.5-15.1 ms, systrap 13.5-20.0 ms
depending on the moment), so the choice flipped with the machine's noise, and a day's servers ran
on systrap, where envd's ``commands.run("echo hi")`` took 44 ms p50 against ptrace's 29 and
``/bin/true`` from ``bash`` 28.6 ms per start against 14.4. The fork inside the sandbox is what
systrap pays for (a new address space and its stub): with it, the probe's command is 40-43 ms on
systrap against 22-25 on ptrace, a margin noise does not flip.

The probe container runs the host's own root file system read-only, without network, as root:
nothing it runs is untrusted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from forkyard.runtime.kvm import kvm_unusable_reason
from forkyard.storage.atomic import exclusive, write_json_atomic

if TYPE_CHECKING:
    from forkyard.runtime.gvisor.runsc import Runsc

log = logging.getLogger(__name__)

#: Machine-wide: the measurement is about the runsc binary and the kernel, not one data directory
#: (every test server has its own data directory and must not measure again).
CACHE_FILE = Path("/var/cache/forkyard/runsc-platform.json")
#: How many of each operation one sandbox's life is taken to have: it starts once (a restore from
#: a template snapshot, mostly made ahead of demand; sometimes a cold run), runs an agent's episode
#: of commands (tens of tool calls), and is paused and resumed once.
WEIGHTS = {"run_ms": 1.0, "command_ms": 50.0, "checkpoint_ms": 1.0, "restore_ms": 1.0}
#: Part of the cache key: a new probe (what it times, its weights) measures again.
PROBE_VERSION = 3
#: Commands timed inside the probe container (the median counts).
COMMANDS = 30
#: Rounds per platform; each operation counts with its fastest round (the machine is shared).
ROUNDS = 2
#: Seconds any one probe step may take (a platform that cannot run here may hang).
STEP_TIMEOUT = 30.0

#: A server answering each POST with the output of ``sh -c "/bin/true; echo hi"`` (run with
#: captured pipes, as envd runs a command; the shell forks and execs a process of its own) and a
#: client process timing :data:`COMMANDS` requests over loopback, each on a new connection; prints
#: the median in nanoseconds.
_COMMAND_LOOP = f"""
import http.client, http.server, os, subprocess, threading, time
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        out = subprocess.run(["/bin/sh", "-c", "/bin/true; echo hi"], capture_output=True).stdout
        self.send_response(200)
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
client = os.fork()
if client == 0:
    times = []
    for _ in range({COMMANDS}):
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1])
        start = time.perf_counter_ns()
        conn.request("POST", "/", body=b"echo hi")
        assert conn.getresponse().read() == b"hi\\n"
        times.append(time.perf_counter_ns() - start)
        conn.close()
    print(sorted(times)[len(times) // 2], flush=True)
    os._exit(0)
os.waitpid(client, 0)  # not os.wait(): that could reap a command the server is running
"""
#: A Python process holding 40 MiB of non-zero memory, like envd's heap: what a checkpoint saves.
_HOLDER = "x = bytes(range(256)) * (160 << 10); print('ready', flush=True); import time; time.sleep(600)"

Measurement = dict[str, float]


class ProbeFailed(Exception):
    """A probe step failed or timed out: the platform does not run here."""


def candidates() -> list[str]:
    """The platforms worth measuring on this machine."""
    found = ["ptrace", "systrap"]
    reason = kvm_unusable_reason()
    if reason is None:
        found.append("kvm")
    else:
        log.info("runsc platform auto: not measuring kvm (%s)", reason)
    return found


def choose(runsc: Runsc, cache_file: Path = CACHE_FILE) -> str:
    """The cached choice for ``runsc``'s binary and this kernel, else measure and cache it.
    Concurrent servers wait for the first one's measurement instead of disturbing it."""
    key = _cache_key(runsc.binary)
    with exclusive(cache_file.with_name(cache_file.name + ".lock")):
        cache = _read_cache(cache_file)
        if key in cache:
            return str(cache[key]["platform"])
        measured = {p: m for p in candidates() if (m := measure(runsc, p)) is not None}
        if not measured:
            log.warning("runsc platform auto: no platform ran the probe container, using ptrace")
            return "ptrace"
        chosen = min(measured, key=lambda p: score(measured[p]))
        log.info("runsc platform auto: %s (measured %s)", chosen, measured)
        cache[key] = {"platform": chosen, "measured": measured, "at": time.time()}
        try:
            write_json_atomic(cache_file, cache, indent=2)
        except OSError as exc:  # a read-only /var/cache: measure again next time
            log.warning("runsc platform auto: cannot cache the choice in %s: %s", cache_file, exc)
        return chosen


def score(m: Measurement) -> float:
    return sum(weight * m[op] for op, weight in WEIGHTS.items())


def measure(runsc: Runsc, platform: str) -> Measurement | None:
    """Milliseconds of each operation of :data:`WEIGHTS` on ``platform``; None if it fails."""
    rounds = []
    try:
        for _ in range(ROUNDS):
            rounds.append(_one_round(runsc, platform))
    except ProbeFailed as exc:
        log.info("runsc platform auto: %s does not run here: %s", platform, exc)
        return None
    finally:
        shutil.rmtree(runsc.root, ignore_errors=True)
    return {op: round(min(r[op] for r in rounds), 1) for op in WEIGHTS}


def _one_round(runsc: Runsc, platform: str) -> Measurement:
    scratch = runsc.root / "probe"
    scratch.mkdir(parents=True, exist_ok=True)
    flags = runsc.sandbox_flags(platform, network="none")
    try:
        return {**_time_commands(runsc, flags, scratch), **_time_checkpoint(runsc, flags, scratch)}
    finally:
        runsc.kill_all()
        shutil.rmtree(scratch, ignore_errors=True)


def _time_commands(runsc: Runsc, flags: list[str], scratch: Path) -> Measurement:
    """A run whose init times commands inside: the rest of the run's wall time is the sandbox's
    own start and exit (and the Python interpreter's)."""
    python = os.path.realpath(sys.executable)
    bundle = _bundle(scratch / "commands", [python, "-S", "-c", _COMMAND_LOOP])
    started = time.monotonic()
    out = _step(runsc.command(*flags, "run", "--bundle", str(bundle), "probe-commands"))
    wall_ms = (time.monotonic() - started) * 1000
    numbers = re.findall(r"^\d+$", out, re.MULTILINE)
    if not numbers:
        raise ProbeFailed(f"the command loop printed no time: {out[-300:]!r}")
    command_ms = int(numbers[-1]) / 1e6
    return {"command_ms": command_ms, "run_ms": max(0.0, wall_ms - COMMANDS * command_ms)}


def _time_checkpoint(runsc: Runsc, flags: list[str], scratch: Path) -> Measurement:
    """Checkpoint a process holding 40 MiB, then restore it."""
    holder = _bundle(scratch / "holder", [os.path.realpath(sys.executable), "-S", "-c", _HOLDER])
    cid, image, output = "probe-holder", scratch / "image", scratch / "holder.out"
    _step(runsc.command(*flags, "run", "--detach", "--bundle", str(holder), cid), output)
    _wait_for_line(output, "ready")
    image.mkdir()
    started = time.monotonic()
    _step(runsc.command("checkpoint", "--compression=none", "--image-path", str(image), cid))
    checkpoint_ms = (time.monotonic() - started) * 1000
    runsc.kill_all()
    runsc.forget(cid)
    started = time.monotonic()
    restore = ["restore", "--detach", "--image-path", str(image), "--bundle", str(holder), cid]
    _step(runsc.command(*flags, *restore), output)
    restore_ms = (time.monotonic() - started) * 1000
    runsc.kill_all()
    runsc.forget(cid)
    return {"checkpoint_ms": checkpoint_ms, "restore_ms": restore_ms}


def _bundle(path: Path, args: list[str]) -> Path:
    """An OCI bundle running ``args`` on the host's root file system, read-only."""
    path.mkdir(parents=True)
    spec = {
        "ociVersion": "1.0.2",
        "process": {
            "args": args,
            "cwd": "/",
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "user": {"uid": 0, "gid": 0},
        },
        "root": {"path": "/", "readonly": True},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]},
    }
    (path / "config.json").write_text(json.dumps(spec))
    return path


def _step(cmd: list[str], output: Path | None = None) -> str:
    """Run one probe command; its output, which a detached sandbox keeps open (so it goes to the
    file ``output`` then, never a pipe we would wait on)."""
    try:
        if output is None:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=STEP_TIMEOUT)
            text = (proc.stdout + proc.stderr).decode(errors="replace")
        else:
            with output.open("ab") as out:
                proc = subprocess.run(
                    cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=STEP_TIMEOUT
                )
            text = output.read_text(errors="replace")
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"{' '.join(cmd[3:6])} timed out after {STEP_TIMEOUT:.0f}s") from None
    if proc.returncode != 0:
        raise ProbeFailed(f"{' '.join(cmd[3:6])}: {text[-500:]}")
    return text


def _wait_for_line(path: Path, line: str) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT
    while line not in path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise ProbeFailed(f"the probe process never printed {line!r}")
        time.sleep(0.01)


def _cache_key(binary: str) -> str:
    """The runsc binary (resolved path, size, mtime: an upgrade changes them), the kernel and the
    probe's version."""
    path = shutil.which(binary) or binary
    real = os.path.realpath(path)
    st = os.stat(real)
    uname = os.uname()
    return f"{real}:{st.st_size}:{st.st_mtime_ns} {uname.release} {uname.version} probe {PROBE_VERSION}"


def _read_cache(cache_file: Path) -> dict[str, dict[str, object]]:
    try:
        value = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
