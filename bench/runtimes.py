"""Runtimes side by side: gVisor and QEMU (TCG here) on the same lifecycle operations, each
through its own real ``forkyard serve`` and the official e2b SDK.

    .venv/bin/python -m bench --only runtimes --runs 20

Per runtime:

* cold create -> first command (the template is booted), then kill;
* on one parent holding a file and a running process, rounds of: pause; resume (``connect``) ->
  first command; snapshot (the parent keeps running); create from that snapshot -> first
  command; fork 2 -> both children answering; kill (every sandbox of the round).

Both servers run with the same settings: template snapshots and warm pools off, so a cold create
is a boot on both runtimes and every other figure is a snapshot operation of the runtime itself.
QEMU under TCG boots a kernel and a python envd on an emulated CPU (20 s to minutes on this
2-core host), so it runs ``min(runs, QEMU_COLD_RUNS)`` cold creates and ``min(runs, QEMU_ROUNDS)``
rounds; the counts are in the result. The QEMU server logs the phases of every boot, pause,
snapshot, resume and restore (``forkyard.runtime.qemu``): ``qemu_<operation>_p50_ms`` are their
medians, ``qemu_phases`` the full statistics.

Also refreshes ``bench/results/reflink.json`` (reflink disk layers, :mod:`bench.reflink`).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import reflink
from bench.harness import serve, stats, write_result
from forkyard.storage.reflink import ReflinkPool

RUNTIMES = ("gvisor", "qemu")
QEMU_COLD_RUNS = 3
QEMU_ROUNDS = 10
FORK_COUNT = 2
OPERATIONS = (
    "cold_create_to_first_command",
    "pause",
    "resume_to_first_command",
    "snapshot",
    "create_from_snapshot_to_first_command",
    "fork2_to_all_answering",
    "kill",
)
#: Same settings for both servers (see the module docstring).
SERVER_ENV = {"FORKYARD_TEMPLATE_SNAPSHOTS": "0", "FORKYARD_WARM_POOL_HIGH": "0"}
#: Generous: a TCG guest answers slowly, and the bench must not fail on a loaded host.
REQUEST_TIMEOUT = 900.0
STATE_PROCESS = "nohup sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 &"
PHASE_LINE = re.compile(r"qemu \S+: (\w+) in (\d+) ms \(([^)]*)\)")

Samples = dict[str, list[float]]


def _run_cmd(sbx: Any) -> None:
    sbx.commands.run("true", timeout=120, request_timeout=120)


def _clocked(samples: Samples, operation: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    samples[operation].append(time.perf_counter() - start)
    return result


def _cold(opts: dict[str, Any], samples: Samples) -> None:
    from e2b import Sandbox

    def create_and_run() -> Any:
        sbx = Sandbox.create("base", timeout=900, **opts)
        _run_cmd(sbx)
        return sbx

    sbx = _clocked(samples, "cold_create_to_first_command", create_and_run)
    _clocked(samples, "kill", sbx.kill)


def _round(parent: Any, opts: dict[str, Any], samples: Samples) -> Any:
    """One round of the lifecycle on ``parent``; returns the resumed parent."""
    from e2b import Sandbox

    _clocked(samples, "pause", parent.pause)

    def resume() -> Any:
        resumed = Sandbox.connect(parent.sandbox_id, timeout=900, **opts)
        _run_cmd(resumed)
        return resumed

    parent = _clocked(samples, "resume_to_first_command", resume)
    snap = _clocked(samples, "snapshot", parent.create_snapshot)
    try:

        def create_from_snapshot() -> Any:
            child = Sandbox.create(snap.snapshot_id, timeout=900, **opts)
            _run_cmd(child)
            return child

        child = _clocked(samples, "create_from_snapshot_to_first_command", create_from_snapshot)
        _clocked(samples, "kill", child.kill)
        _fork(parent, samples)
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id, **opts)
    return parent


def _fork(parent: Any, samples: Samples) -> None:
    start = time.perf_counter()
    results = parent.fork(count=FORK_COUNT, timeout=900, request_timeout=REQUEST_TIMEOUT)
    children = [c for c in results if not isinstance(c, Exception)]
    try:
        for child in children:
            _run_cmd(child)
        if len(children) != FORK_COUNT:
            raise RuntimeError(f"fork {FORK_COUNT}: {[str(e) for e in results if isinstance(e, Exception)]}")
        samples["fork2_to_all_answering"].append(time.perf_counter() - start)
    finally:
        for child in children:
            _clocked(samples, "kill", child.kill)


def _lifecycle(opts: dict[str, Any], rounds: int, samples: Samples, errors: list[str]) -> None:
    from e2b import Sandbox

    parent = Sandbox.create("base", timeout=3600, **opts)
    try:
        parent.files.write("/home/user/state.txt", "bench", request_timeout=120)
        parent.commands.run(STATE_PROCESS, timeout=120, request_timeout=120)
        failed_in_a_row = 0
        for _ in range(rounds):
            try:
                parent = _round(parent, opts, samples)
                failed_in_a_row = 0
            except Exception as exc:  # recorded; only a parent that keeps failing ends the rounds
                errors.append(f"round: {type(exc).__name__}: {exc}")
                failed_in_a_row += 1
                if failed_in_a_row == 3:
                    break
    finally:
        parent.kill()


def _phases(server_log: Path) -> dict[str, dict[str, list[float]]]:
    """Per operation (boot, resume, restore, pause, snapshot): seconds of its total and of each
    phase, from the QEMU runtime's log lines."""
    found: dict[str, dict[str, list[float]]] = {}
    for match in PHASE_LINE.finditer(server_log.read_text(errors="replace")):
        what, total, parts = match.groups()
        phases = found.setdefault(what, {"total": []})
        phases["total"].append(int(total) / 1000)
        for part in parts.split(", "):
            name, _, ms = part.rpartition(" ")
            phases.setdefault(name, []).append(int(ms) / 1000)
    return found


def _phase_report(found: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """One readable line of p50s per operation (the summary table shows scalars as lines) and
    the full statistics as a list (kept out of the table: it would add ~30 rows)."""
    lines = {
        f"qemu_{what}_p50_ms": ", ".join(f"{name} {stats(v)['p50_ms']:.0f}" for name, v in phases.items())
        for what, phases in found.items()
    }
    full = [
        {"operation": what, "phase": name, **stats(v)}
        for what, phases in found.items()
        for name, v in phases.items()
    ]
    return {**lines, "qemu_phases": full}


def _release(data_dir: Path) -> None:
    """The QEMU server's reflink pool is loop-mounted in its data dir (so the harness left the dir
    alone): unmount it, then delete the directory unless something else is still mounted below
    it (never rm -rf through a mount)."""
    ReflinkPool(data_dir).destroy()
    if not any(m.startswith(str(data_dir)) for m in Path("/proc/mounts").read_text().split()):
        shutil.rmtree(data_dir, ignore_errors=True)


def measure(runtime: str, cold_runs: int, rounds: int) -> dict[str, Any]:
    samples: Samples = {op: [] for op in OPERATIONS}
    errors: list[str] = []
    with serve(runtime=runtime, extra_env=SERVER_ENV) as server:
        data_dir = server.data_dir
        opts: dict[str, Any] = {
            "api_key": server.api_key,
            "api_url": server.url,
            "sandbox_url": server.url,
            "request_timeout": REQUEST_TIMEOUT,
        }
        for _ in range(cold_runs):
            try:
                _cold(opts, samples)
            except Exception as exc:
                errors.append(f"cold create: {type(exc).__name__}: {exc}")
        _lifecycle(opts, rounds, samples, errors)
        # Read while the server runs: the harness may delete its data dir on the way out.
        phases = _phase_report(_phases(server.log_path)) if runtime == "qemu" else {}
    _release(data_dir)
    return {"samples": samples, "errors": errors, "phases": phases}


def run(server_url: str, api_key: str, runs: int) -> dict[str, object]:
    """``server_url``/``api_key`` (the default server of ``python -m bench``) are not used: each
    runtime gets a server of its own with the same settings."""
    write_result("reflink", reflink.run(runs, 100))
    counts = {"gvisor": (runs, runs), "qemu": (min(runs, QEMU_COLD_RUNS), min(runs, QEMU_ROUNDS))}
    measured = {name: measure(name, *counts[name]) for name in RUNTIMES}
    return {
        "operations": {
            op: {name: stats(measured[name]["samples"][op]) for name in RUNTIMES} for op in OPERATIONS
        },
        **measured["qemu"]["phases"],
        "errors": {name: measured[name]["errors"] for name in RUNTIMES},
        **{
            f"runs_{name}": f"{cold} cold creates, {rounds} lifecycle rounds (fork {FORK_COUNT})"
            for name, (cold, rounds) in counts.items()
        },
        "notes": "gVisor: the pinned runsc (scripts/bootstrap.sh), its measured platform; "
        "QEMU: -M microvm under TCG (no vmx/svm), "
        "512 MiB guest; both servers with template snapshots and warm pools off",
    }
