"""Lifecycle benchmark (issue 9, "lifecycle at memory speed"): every lifecycle operation through
the official e2b SDK against real servers, each figure beside a baseline measured in the same
run, and a target row per operation (met or not, judged on the p50).

    .venv/bin/python -m bench --only lifecycle --runs 20     # or: python -m bench.lifecycle 20

Three servers, one after the other:

* **cold** (``FORKYARD_TEMPLATE_SNAPSHOTS=false``): cold create -> first command, a real boot of
  the template. The baseline of the create and restore rows.
* **disk** (``FORKYARD_PAUSE_FREEZE=false``, ``FORKYARD_SNAPSHOT_STANDBYS=0``): every pause is a
  checkpoint to disk at once and every create from a snapshot a restore. Gives pause to disk,
  resume from disk -> first command and create from a snapshot (restore) -> first command. A
  frozen sandbox moved to disk later (``FORKYARD_PAUSE_DISK_AFTER_SECONDS``) is the same
  checkpoint and the same resume; this server measures it without waiting for the tier.
* **main** (the server ``python -m bench`` runs, production settings: warm pool, standbys, the
  frozen tier with its 120 s disk-after): create from the template (a warm-pool claim), create
  from a snapshot's standby, pause (frozen) and resume of a frozen sandbox -> first command,
  ``echo hi`` round trip beside ``GET /health``, snapshot of a sandbox that just wrote 100 MiB,
  a group of 16 created at once from a snapshot's standbys (the first group sizes them), fork 16,
  64 forks answering, kill.

Every sandbox's origin (``warm_pool``, ``standby``, ``snapshot``...) and every pause's tier
(``frozen``, ``disk``) is read from the server's database (``<data_dir>/forkyard.sqlite3``): a
sample lands in a row only when the server really took that path (the others are counted in
``paths_seen``). Before each timed operation the bench waits until no warm pool or standby pool
is refilling (a restore in the background would share the two cores with the measurement) and
then until the cores are quiet (at most 3 s: a sandbox just restored into a pool runs for a
few hundred milliseconds more).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ServerProcess, stats, write_result

FORK_COUNT = 16
MANY_FORKS = 64
#: Repetitions of the fork rows (a fork 16 restores 17 sandboxes: ~10 s each here).
FORK_RUNS_DEFAULT = 3
ONE_HUNDRED_MIB = 100 << 20
#: ``echo hi`` / ``GET /health`` pairs per run.
ROUND_TRIPS_PER_RUN = 5
STATE_PROCESS = "nohup sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 &"
#: Creates from one snapshot before it gets standbys (forkyard.orchestrator.standbys).
RESTORES_BEFORE_STANDBYS = 2
POOL_WAIT_SECONDS = 60.0
#: After the pools settle, wait (at most this long) until the machine is quiet: a sandbox just
#: restored into a pool still runs for a few hundred ms (its sentry, envd settling).
QUIET_WAIT_SECONDS = 3.0
#: Quiet: all cores together busy less than this fraction over :data:`QUIET_WINDOW_SECONDS`.
QUIET_BUSY = 0.15
QUIET_WINDOW_SECONDS = 0.1
#: A server's start-up: the template is booted and snapshotted, then its pool restored.
START_WAIT_SECONDS = 180.0
REQUEST_TIMEOUT = 600.0

COLD_ENV = {"FORKYARD_TEMPLATE_SNAPSHOTS": "false"}
DISK_ENV = {"FORKYARD_PAUSE_FREEZE": "false", "FORKYARD_SNAPSHOT_STANDBYS": "0"}


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    target_ms: float | None
    baseline: str
    #: For rows that are a count, not a time: how many must pass.
    count: int | None = None


#: The issue's targets (p50 over the runs, this machine) and each row's baseline.
TARGETS = (
    Target("pause", "pause (frozen in place)", 50, "pause_to_disk"),
    Target(
        "resume_frozen_to_first_command",
        "resume of a frozen sandbox -> first command",
        50,
        "resume_from_disk_to_first_command",
    ),
    Target(
        "resume_from_disk_to_first_command",
        "resume from disk -> first command",
        300,
        "cold_create_to_first_command",
    ),
    Target(
        "template_create_to_first_command",
        "create from template (warm pool) -> first command",
        50,
        "cold_create_to_first_command",
    ),
    Target(
        "create_from_snapshot_to_first_command",
        "create from a snapshot (restore) -> first command",
        300,
        "cold_create_to_first_command",
    ),
    Target(
        "create_from_snapshot_standby_to_first_command",
        "create from a snapshot (standby) -> first command",
        50,
        "create_from_snapshot_to_first_command",
    ),
    Target(
        "snapshot_after_100mib_write_unavailable",
        "snapshot after a 100 MiB write: unavailable (request + first command)",
        300,
        "pause_to_disk",
    ),
    Target(
        "snapshot_after_100mib_write_prober_gap",
        "snapshot after a 100 MiB write: longest gap of a concurrent prober",
        300,
        "echo_hi_round_trip",
    ),
    Target(
        "fork16_to_all_answering",
        "fork 16 -> all answering",
        2000,
        "create_from_snapshot_to_first_command",
    ),
    Target(
        "group16_from_standbys_to_all_answering",
        "16 creates at once from a snapshot's standbys -> all answering",
        500,
        "fork16_to_all_answering",
    ),
    Target("echo_hi_round_trip", "`echo hi` round trip", 30, "http_health_round_trip"),
    Target("kill", "kill", 50, "http_health_round_trip"),
    Target(
        "fork64_to_all_answering",
        f"{MANY_FORKS} forks on one node, all answering",
        None,
        "fork16_to_all_answering",
        count=MANY_FORKS,
    ),
)


# -- what the server did: its database and its log -------------------------------------------


class ServerDatabase:
    """Read-only queries on a server's ``forkyard.sqlite3`` (short connections; WAL mode)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "forkyard.sqlite3"

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30)
        try:
            yield db
        finally:
            db.close()

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        with self._db() as db:
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
        return dict(row) if row is not None else {}

    def origin(self, sandbox_id: str) -> str:
        return str(self.sandbox(sandbox_id).get("origin") or "unknown")

    def pause_tier(self, sandbox_id: str) -> str:
        return str(self.sandbox(sandbox_id).get("pause_tier") or "none")

    def sandbox_ids(self) -> set[str]:
        with self._db() as db:
            return {r[0] for r in db.execute("SELECT sandbox_id FROM sandboxes")}

    def events(self, message_prefix: str) -> list[tuple[str, dict[str, str]]]:
        """(sandbox id, fields) of the sandbox log events whose message starts with the prefix."""
        with self._db() as db:
            rows = db.execute(
                "SELECT sandbox_id, fields FROM sandbox_logs WHERE message LIKE ? ORDER BY id",
                (message_prefix.replace("%", "") + "%",),
            ).fetchall()
        return [(sid, json.loads(fields or "{}")) for sid, fields in rows]


POOL_READY = re.compile(r"warm pool (\S+): (\S+) ready in")


def _env_int(name: str, default: int, env: dict[str, str]) -> int:
    return int(env.get(name, os.environ.get(name, default)))


class Pools:
    """The server's warm pool and standby pools, as its log and database show them.

    A pool holds the sandboxes its log announced (``warm pool <key>: <id> ready in``) that have
    no database row yet (a claim adds the row). A claim that empties a pool starts a refill up to
    ``high``; one from a snapshot restored ``RESTORES_BEFORE_STANDBYS`` times starts its
    standbys. :meth:`settle` waits until every refill the bench caused has finished.
    """

    def __init__(self, server: ServerProcess, env: dict[str, str] | None = None) -> None:
        env = env or {}
        self.server = server
        self.database = ServerDatabase(server.data_dir)
        self.template_high = _env_int("FORKYARD_WARM_POOL_HIGH", 2, env)
        self.standby_high = _env_int("FORKYARD_SNAPSHOT_STANDBYS", 2, env)
        self._pending: dict[str, int] = {}  # pool key -> announced sandboxes to wait for
        self._restores: Counter[str] = Counter()
        self.errors: list[str] = []
        #: Seconds :meth:`settle` waited in all.
        self.waited_s = 0.0

    def announced(self) -> dict[str, list[str]]:
        pools: dict[str, list[str]] = {}
        for key, sid in POOL_READY.findall(self.server.log_path.read_text(errors="replace")):
            pools.setdefault(key, []).append(sid)
        return pools

    def _template_key(self, pools: dict[str, list[str]]) -> str | None:
        keys = [k for k in pools if ":" in k]  # template keys are runtime:template:build:envd
        return keys[-1] if keys else None

    def wait_template_pool(self) -> None:
        """At start-up: until the template's pool is full (its snapshot is made first)."""
        deadline = time.monotonic() + START_WAIT_SECONDS
        while True:
            pools = self.announced()
            key = self._template_key(pools)
            if key is not None and self._ready(key, pools) >= max(1, self.template_high):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the warm pool did not fill in {START_WAIT_SECONDS:.0f} s:\n{self.server.log_tail()}"
                )
            time.sleep(0.05)

    def _ready(self, key: str, pools: dict[str, list[str]]) -> int:
        """Sandboxes of the pool ``key`` not claimed yet."""
        claimed = self.database.sandbox_ids()
        return sum(1 for sid in pools.get(key, []) if sid not in claimed)

    def create(self, template: str, timeout: int = 600) -> Created:
        """Create -> first command, and book what the create did to the pools. The pools are
        read before the create: a refill starts with the claim, and may announce a sandbox
        before the create returns."""
        before = self.announced()
        claimed = self.database.sandbox_ids()
        created = create_to_first_command(template, self.server, timeout)
        sbx = created.sandbox
        rec = self.database.sandbox(sbx.sandbox_id)
        origin = str(rec.get("origin") or "unknown")
        if origin in ("warm_pool", "standby"):
            key = next((k for k, sids in before.items() if sbx.sandbox_id in sids), None)
            ready = sum(1 for sid in before.get(key or "", []) if sid not in claimed)
            if key is not None and ready <= 1:  # the claim emptied the pool: it refills to high
                high = self.template_high if origin == "warm_pool" else self.standby_high
                self._pending[key] = len(before[key]) + high
        elif origin == "snapshot" and self.standby_high > 0:
            source = str(rec.get("restored_from") or "")
            self._restores[source] += 1
            if self._restores[source] == RESTORES_BEFORE_STANDBYS:  # its standbys start
                self._pending[source] = len(before.get(source, [])) + self.standby_high
        created.origin = origin
        return created

    def wait_ready(self, key: str, count: int) -> bool:
        """Until the pool ``key`` holds ``count`` unclaimed sandboxes (False: not in
        :data:`POOL_WAIT_SECONDS`, booked as an error), then until the cores are quiet."""
        started = time.monotonic()
        while (ready := self._ready(key, self.announced())) < count:
            if time.monotonic() - started > POOL_WAIT_SECONDS:
                self.errors.append(f"pool {key}: {ready} of {count} ready after {POOL_WAIT_SECONDS:.0f} s")
                return False
            time.sleep(0.05)
        _wait_quiet()
        self.waited_s += time.monotonic() - started
        return True

    def forget(self, snapshot_id: str) -> None:
        """The snapshot was deleted: its standbys go, and a refill of them never finishes."""
        self._pending.pop(snapshot_id, None)

    def settle(self) -> None:
        started = time.monotonic()
        while self._pending:
            pools = self.announced()
            for key, wanted in list(self._pending.items()):
                if len(pools.get(key, [])) >= wanted:
                    del self._pending[key]
            if self._pending and time.monotonic() - started > POOL_WAIT_SECONDS:
                log = self.server.log_path.read_text(errors="replace").splitlines()
                why = [line for line in log if "warm pool" in line and "failed" in line][-2:]
                self.errors.append(
                    f"pools {sorted(self._pending)} (announced {dict(self._counts(pools))}, wanted "
                    f"{self._pending}) did not refill in {POOL_WAIT_SECONDS:.0f} s: {why}"
                )
                self._pending.clear()
            time.sleep(0.02)
        _wait_quiet()
        self.waited_s += time.monotonic() - started

    @staticmethod
    def _counts(pools: dict[str, list[str]]) -> Counter[str]:
        return Counter({key: len(sids) for key, sids in pools.items()})


# -- small helpers ---------------------------------------------------------------------------


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _wait_quiet() -> None:
    """Until the cores are busy less than :data:`QUIET_BUSY` over a short window, at most
    :data:`QUIET_WAIT_SECONDS` (a shared machine may never be quiet: then measure anyway)."""
    deadline = time.monotonic() + QUIET_WAIT_SECONDS
    while time.monotonic() < deadline:
        busy0, total0 = _cpu_times()
        time.sleep(QUIET_WINDOW_SECONDS)
        busy1, total1 = _cpu_times()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) < QUIET_BUSY:
            return


def _sdk(server: ServerProcess) -> dict[str, Any]:
    return {**server.sdk_opts, "request_timeout": REQUEST_TIMEOUT}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _first_command(sbx: Any) -> None:
    result = sbx.commands.run("echo hi")
    if result.stdout.strip() != "hi":
        raise RuntimeError(f"sandbox {sbx.sandbox_id} answered {result.stdout!r}")


@dataclass
class Created:
    sandbox: Any
    #: Create request -> first command answered.
    seconds: float
    #: The create request alone.
    request_s: float
    #: The database's ``origin`` (booked by :meth:`Pools.create`).
    origin: str = "unknown"


def create_to_first_command(template: str, server: ServerProcess, timeout: int = 600) -> Created:
    from e2b import Sandbox

    start = time.perf_counter()
    sbx = Sandbox.create(template, timeout=timeout, **_sdk(server))
    request_s = time.perf_counter() - start
    _first_command(sbx)
    return Created(sbx, time.perf_counter() - start, request_s)


def resume_to_first_command(sandbox_id: str, server: ServerProcess) -> tuple[Any, float, float]:
    """``Sandbox.connect`` (the resume) -> first command: (sandbox, seconds, the connect alone)."""
    from e2b import Sandbox

    start = time.perf_counter()
    sbx = Sandbox.connect(sandbox_id, timeout=600, **_sdk(server))
    connect_s = time.perf_counter() - start
    _first_command(sbx)
    return sbx, time.perf_counter() - start, connect_s


def _make_parent(pools: Pools) -> Any:
    """A sandbox with a running process and a file: the state snapshots and forks copy."""
    parent = pools.create("base", timeout=3600).sandbox
    parent.commands.run(STATE_PROCESS)
    parent.files.write("/home/user/state.txt", "bench")
    return parent


def describe_runtime(sandbox_id: str) -> str:
    """The runsc build and platform a live sandbox runs on, read from its runsc-sandbox process
    (``--platform``; runsc's default is ptrace), e.g. ``runsc 0.0~20240729.0, platform ptrace``."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            if not args[0].endswith(b"runsc-sandbox") or sandbox_id.encode() not in b" ".join(args):
                continue
            exe = os.readlink(cmdline.parent / "exe")
        except OSError:
            continue
        platform = next(
            (a.split(b"=", 1)[1].decode() for a in args if a.startswith(b"--platform=")), "ptrace"
        )
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
            version = out.split("\n", 1)[0].replace("runsc version ", "").strip()
        except (OSError, subprocess.SubprocessError):
            version = "unknown"
        return f"runsc {version}, platform {platform}, {os.cpu_count()} cores"
    return "unknown (no runsc-sandbox process found)"


def _fork_runs(runs: int) -> int:
    return max(1, min(runs, int(os.environ.get("FORKYARD_BENCH_FORK_RUNS", FORK_RUNS_DEFAULT))))


# -- the servers -----------------------------------------------------------------------------


def _cold(runs: int, samples: dict[str, list[float]]) -> None:
    from bench.harness import serve

    with serve(extra_env=COLD_ENV) as cold:
        database = ServerDatabase(cold.data_dir)
        for _ in range(runs):
            created = create_to_first_command("base", cold)
            if database.origin(created.sandbox.sandbox_id) == "boot":
                samples["cold_create_to_first_command"].append(created.seconds)
            created.sandbox.kill()


def _disk(runs: int, samples: dict[str, list[float]], seen: Counter[str]) -> list[str]:
    """Pause to disk, resume from disk, create from a snapshot (restore): a server without the
    frozen tier and without standbys. Returns the errors."""
    from e2b import Sandbox

    from bench.harness import serve

    with serve(extra_env=DISK_ENV) as disk:
        pools = Pools(disk, DISK_ENV)
        pools.wait_template_pool()
        parent = _make_parent(pools)
        snap = parent.create_snapshot()
        parent.kill()
        for _ in range(runs):
            pools.settle()
            created = pools.create(snap.snapshot_id)
            child = created.sandbox
            seen[f"disk server create from snapshot: {created.origin}"] += 1
            if created.origin == "snapshot":
                samples["create_from_snapshot_to_first_command"].append(created.seconds)
                samples["create_from_snapshot_request"].append(created.request_s)
            child.commands.run("true")
            pools.settle()
            seconds = _timed(child.pause)
            tier = pools.database.pause_tier(child.sandbox_id)
            seen[f"disk server pause: {tier}"] += 1
            if tier == "disk":
                samples["pause_to_disk"].append(seconds)
            resumed, seconds, connect_s = resume_to_first_command(child.sandbox_id, disk)
            if tier == "disk":
                samples["resume_from_disk_to_first_command"].append(seconds)
                samples["resume_from_disk_request"].append(connect_s)
            resumed.kill()
        Sandbox.delete_snapshot(snap.snapshot_id, **_sdk(disk))
    return [f"disk server: {e}" for e in pools.errors]


def _round_trips(server: ServerProcess, runs: int, pools: Pools, samples: dict[str, list[float]]) -> str:
    """``echo hi`` through envd beside ``GET /health`` of the API (the floor of any request).
    Returns what the sandbox runs on (:func:`describe_runtime`)."""
    sbx = pools.create("base").sandbox
    pools.settle()
    runtime = describe_runtime(sbx.sandbox_id)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            client.get("/health").raise_for_status()
            _first_command(sbx)
            for _ in range(runs * ROUND_TRIPS_PER_RUN):
                samples["echo_hi_round_trip"].append(_timed(lambda: _first_command(sbx)))
                samples["http_health_round_trip"].append(
                    _timed(lambda: client.get("/health").raise_for_status())
                )
    finally:
        sbx.kill()
    return runtime


def _prober_gap(sbx: Any, action: Callable[[], object]) -> tuple[float, int]:
    """Run ``action`` while another thread runs commands in ``sbx`` back to back; return the
    longest time without an answer across the action (from the last answer before it to the
    first after it, through every answer in between) and the number of failed probes."""
    answers: list[float] = []
    failures = 0
    stop = threading.Event()

    def probe() -> None:
        nonlocal failures
        while not stop.is_set():
            try:
                sbx.commands.run("true", request_timeout=60)
                answers.append(time.perf_counter())
            except Exception:  # unavailable: what is measured; try again
                failures += 1
                time.sleep(0.002)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(answers) < 3 and time.monotonic() < deadline:  # the prober is answering
        time.sleep(0.005)
    begin = time.perf_counter()
    action()
    end = time.perf_counter()
    while not [a for a in answers if a > end] and time.monotonic() < deadline + 60:
        time.sleep(0.005)
    stop.set()
    thread.join(timeout=120)
    before = [a for a in answers if a <= begin]
    marks = [before[-1] if before else begin] + [a for a in answers if a > begin]
    after_end = next((i for i, a in enumerate(marks) if a > end), len(marks) - 1)
    marks = marks[: after_end + 1]
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    return (max(gaps) if gaps else end - begin), failures


def _snapshot_after_write(
    sbx: Any, server: ServerProcess, pools: Pools, samples: dict[str, list[float]]
) -> None:
    """Write 100 MiB, snapshot: request start -> request end -> a command answers; then again
    with a concurrent prober. Both snapshots are deleted."""
    from e2b import Sandbox

    opts = _sdk(server)
    taken: list[str] = []
    write = f"head -c {ONE_HUNDRED_MIB} /dev/urandom > /home/user/blob && sync"
    sbx.commands.run(write)
    pools.settle()
    start = time.perf_counter()
    taken.append(sbx.create_snapshot().snapshot_id)
    _first_command(sbx)
    samples["snapshot_after_100mib_write_unavailable"].append(time.perf_counter() - start)

    sbx.commands.run(write)
    pools.settle()
    gap, _failures = _prober_gap(sbx, lambda: taken.append(sbx.create_snapshot().snapshot_id))
    samples["snapshot_after_100mib_write_prober_gap"].append(gap)
    for snapshot_id in taken:
        Sandbox.delete_snapshot(snapshot_id, **opts)
        pools.forget(snapshot_id)


def _create_group(snapshot_id: str, server: ServerProcess, errors: list[str]) -> tuple[list[Any], float]:
    """:data:`FORK_COUNT` creates from ``snapshot_id`` at once, each until it answers a command:
    (the sandboxes that answered, seconds until the last did)."""
    from e2b import Sandbox

    def member() -> Any:
        try:
            sbx = Sandbox.create(snapshot_id, timeout=600, **_sdk(server))
        except Exception as exc:
            errors.append(f"group create: {exc}")
            return None
        try:
            _first_command(sbx)
        except Exception as exc:
            errors.append(f"group member {sbx.sandbox_id}: {exc}")
            with contextlib.suppress(Exception):
                sbx.kill()
            return None
        return sbx

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=FORK_COUNT) as pool:
        members = list(pool.map(lambda _: member(), range(FORK_COUNT)))
    return [m for m in members if m is not None], time.perf_counter() - start


def _groups_from_standbys(
    snapshot_id: str,
    server: ServerProcess,
    pools: Pools,
    runs: int,
    samples: dict[str, list[float]],
    seen: Counter[str],
    errors: list[str],
) -> None:
    """A GRPO trainer's step: a group of 16 created at once from one start state. The first
    group (restores) makes the snapshot keep 16 standbys; each timed group claims them."""
    members, _ = _create_group(snapshot_id, server, errors)
    _kill_all(members)
    for _ in range(runs):
        if not pools.wait_ready(snapshot_id, FORK_COUNT):
            return
        members, seconds = _create_group(snapshot_id, server, errors)
        origins = Counter(pools.database.origin(m.sandbox_id) for m in members)
        seen.update({f"group create from snapshot: {o}": n for o, n in origins.items()})
        if origins["standby"] == FORK_COUNT:
            samples["group16_from_standbys_to_all_answering"].append(seconds)
        else:
            errors.append(f"group of {FORK_COUNT} from standbys: origins {dict(origins)}")
        _kill_all(members)


def _all_answer(children: list[Any]) -> int:
    """Run a command in every child at once; how many answered."""

    def answer(child: Any) -> bool:
        try:
            _first_command(child)
            return True
        except Exception:
            return False

    if not children:
        return 0
    with ThreadPoolExecutor(max_workers=min(16, len(children))) as pool:
        return sum(pool.map(answer, children))


def _kill_all(children: list[Any]) -> None:
    def kill(child: Any) -> None:
        with contextlib.suppress(Exception):
            child.kill()

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(kill, children))


def _forks(
    parent: Any,
    server: ServerProcess,
    pools: Pools,
    runs: int,
    samples: dict[str, list[float]],
    errors: list[str],
) -> dict[str, Any]:
    """Fork 16 through the SDK (``runs`` times), then 64 through the API (``POST .../fork``: the
    SDK stops at 20), each until every child answers a command. Each fork starts on quiet cores
    (the previous run's 16 kills release their networks and disks in the background)."""
    from e2b import Sandbox

    for _ in range(runs):
        pools.settle()
        start = time.perf_counter()
        results = parent.fork(count=FORK_COUNT, timeout=600)
        children = [c for c in results if isinstance(c, Sandbox)]
        errors.extend(f"fork {FORK_COUNT}: {e}" for e in results if not isinstance(e, Sandbox))
        answering = _all_answer(children)
        if answering == FORK_COUNT:
            samples["fork16_to_all_answering"].append(time.perf_counter() - start)
        else:
            errors.append(f"fork {FORK_COUNT}: {answering} of {FORK_COUNT} children answered")
        _kill_all(children)

    pools.settle()
    start = time.perf_counter()
    response = httpx.post(
        f"{server.url}/sandboxes/{parent.sandbox_id}/fork",
        json={"count": MANY_FORKS, "timeout": 900},
        headers=server.headers,
        timeout=REQUEST_TIMEOUT,
    )
    response.raise_for_status()
    outcomes = response.json()
    ids = [o["sandbox"]["sandboxID"] for o in outcomes if "sandbox" in o]
    errors.extend(f"fork {MANY_FORKS}: {o['error']}" for o in outcomes if "error" in o)
    fork_s = time.perf_counter() - start

    def connect(sandbox_id: str) -> Any:
        try:
            return Sandbox.connect(sandbox_id, timeout=900, **_sdk(server))
        except Exception as exc:
            errors.append(f"fork {MANY_FORKS}: connecting to {sandbox_id}: {exc}")
            return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        children = [c for c in pool.map(connect, ids) if c is not None]
    answering = _all_answer(children)
    total_s = time.perf_counter() - start
    if answering == MANY_FORKS:
        samples["fork64_to_all_answering"].append(total_s)
    _kill_all(children)
    return {
        "requested": MANY_FORKS,
        "created": len(ids),
        "answering": answering,
        "fork_request_s": round(fork_s, 2),
        "all_answering_s": round(total_s, 2),
    }


def _main(
    server: ServerProcess, runs: int, samples: dict[str, list[float]], seen: Counter[str]
) -> dict[str, Any]:
    from e2b import Sandbox

    opts = _sdk(server)
    pools = Pools(server)
    pools.wait_template_pool()
    errors: list[str] = []

    # Creates from the template: each claims a warm-pool sandbox (the pool is idle before each).
    for _ in range(runs):
        pools.settle()
        created = pools.create("base")
        sbx = created.sandbox
        seen[f"template create: {created.origin}"] += 1
        if created.origin == "warm_pool":
            samples["template_create_to_first_command"].append(created.seconds)
            samples["template_create_request"].append(created.request_s)
        pools.settle()
        samples["kill"].append(_timed(sbx.kill))

    runtime = _round_trips(server, runs, pools, samples)

    parent = _make_parent(pools)
    try:
        snap = parent.create_snapshot()
        # The first creates from the snapshot are restores; then it has standbys.
        for i in range(runs + RESTORES_BEFORE_STANDBYS):
            pools.settle()
            created = pools.create(snap.snapshot_id)
            child = created.sandbox
            seen[f"create from snapshot: {created.origin}"] += 1
            if created.origin == "standby":
                samples["create_from_snapshot_standby_to_first_command"].append(created.seconds)
                samples["create_from_snapshot_standby_request"].append(created.request_s)
            pools.settle()
            seconds = _timed(child.pause)
            tier = pools.database.pause_tier(child.sandbox_id)
            seen[f"pause: {tier}"] += 1
            if tier == "frozen":
                samples["pause"].append(seconds)
            resumed, seconds, connect_s = resume_to_first_command(child.sandbox_id, server)
            if tier == "frozen":
                samples["resume_frozen_to_first_command"].append(seconds)
                samples["resume_frozen_request"].append(connect_s)
            if i >= RESTORES_BEFORE_STANDBYS:  # one snapshot round per run
                _snapshot_after_write(resumed, server, pools, samples)
            resumed.kill()
        pools.settle()
        _groups_from_standbys(snap.snapshot_id, server, pools, _fork_runs(runs), samples, seen, errors)
        Sandbox.delete_snapshot(snap.snapshot_id, **opts)
        pools.forget(snap.snapshot_id)
        pools.settle()
        many = _forks(parent, server, pools, _fork_runs(runs), samples, errors)
    finally:
        with contextlib.suppress(Exception):
            parent.kill()
    errors.extend(pools.errors)
    return {
        "errors": errors,
        "many_forks": many,
        "pool_wait_s": round(pools.waited_s, 1),
        "runtime": runtime,
    }


def run(server: ServerProcess, runs: int) -> dict[str, Any]:
    """``server``: the main server (production settings); the cold and disk servers are started
    here, one at a time."""
    samples: dict[str, list[float]] = {t.key: [] for t in TARGETS}
    samples.update(
        {
            "cold_create_to_first_command": [],
            "pause_to_disk": [],
            "http_health_round_trip": [],
            # The request alone (the rows above add the first command's round trip).
            "template_create_request": [],
            "create_from_snapshot_request": [],
            "create_from_snapshot_standby_request": [],
            "resume_frozen_request": [],
            "resume_from_disk_request": [],
        }
    )
    seen: Counter[str] = Counter()
    _cold(runs, samples)
    disk_errors = _disk(runs, samples, seen)
    main = _main(server, runs, samples, seen)
    summary = {name: stats(values) for name, values in samples.items() if values}
    targets = target_rows(summary, main["many_forks"])
    return {
        "runs": runs,
        "runtime": f"gvisor: {main['runtime']}",
        "fork_runs": _fork_runs(runs),
        "stats": summary,
        "targets": targets,
        "targets_met": f"{sum(1 for t in targets if t['met'])} of {len(targets)}",
        "ratios_to_cold_p50": _ratios(summary),
        "many_forks": main["many_forks"],
        "pool_wait_s": main["pool_wait_s"],
        "paths_seen": dict(sorted(seen.items())),
        "errors": disk_errors + main["errors"],
        "notes": "Servers: cold = template "
        "snapshots off (a boot); disk = FORKYARD_PAUSE_FREEZE=false and standbys off (every pause "
        "a checkpoint, every snapshot create a restore); main = production settings (warm pool, "
        "standbys, frozen tier). A sample counts in a row only when the database shows that path "
        "(origin, pause tier: paths_seen). Unavailable = snapshot request start -> request end -> "
        "first command answers; prober gap = longest time without an answer of a concurrent "
        "command loop (>= one round trip). Fork and group rows: FORKYARD_BENCH_FORK_RUNS (default 3) "
        "runs, a group counted only when all 16 claimed standbys (an untimed first group sizes them); "
        f"{MANY_FORKS} forks once, through POST /sandboxes/{{id}}/fork (the SDK allows 20).",
    }


def target_rows(summary: dict[str, dict[str, float | int]], many: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: the measurement, its baseline (same run), met or not (p50)."""
    rows: list[dict[str, Any]] = []
    for target in TARGETS:
        s = summary.get(target.key, {"n": 0})
        base = summary.get(target.baseline, {"n": 0})
        row: dict[str, Any] = {
            "key": target.key,
            "measurement": target.label,
            "n": s.get("n", 0),
            "p50_ms": s.get("p50_ms"),
            "p95_ms": s.get("p95_ms"),
            "max_ms": s.get("max_ms"),
            "baseline": target.baseline,
            "baseline_p50_ms": base.get("p50_ms"),
        }
        if target.count is not None:
            row["target"] = f"{target.count} of {target.count} answer"
            row["result"] = f"{many.get('answering', 0)} of {many.get('requested', target.count)}"
            row["met"] = many.get("answering", 0) >= target.count
        else:
            row["target"] = f"p50 < {target.target_ms:g} ms"
            p50 = s.get("p50_ms")
            row["met"] = p50 is not None and target.target_ms is not None and float(p50) < target.target_ms
        rows.append(row)
    return rows


def _ratios(summary: dict[str, dict[str, float | int]]) -> dict[str, float]:
    """Each operation's p50 as a fraction of the cold create's p50 measured in the same run."""
    if "cold_create_to_first_command" not in summary:
        return {}
    cold = float(summary["cold_create_to_first_command"]["p50_ms"])
    return {
        name: round(float(s["p50_ms"]) / cold, 4)
        for name, s in summary.items()
        if name != "cold_create_to_first_command" and "p50_ms" in s
    }


def main() -> None:
    """``python -m bench.lifecycle [runs]``: against servers of its own."""
    from bench.harness import serve

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with serve() as server:
        result = run(server, runs)
    path = write_result("lifecycle", result)
    print(json.dumps(result["targets"], indent=2), "\n->", path)


if __name__ == "__main__":
    main()
