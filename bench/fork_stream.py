"""Children as they come up (issue 26, part 1): fork 16 -> the first child answering and -> all 16
answering, through each way of getting 16 sandboxes of one prepared state, on one server with
production settings (warm pool, standbys, frozen tier), the shapes taking turns in each round:

* ``fork_call`` - today's E2B fork: ``parent.fork(count=16)`` (the SDK), answered when all are up;
  every child then runs ``echo hi``. First child answering = the call + the fastest child's
  command.
* ``fork_stream`` - ours: ``forkyard_rl.fork_stream`` over ``POST /sandboxes/{id}/fork/stream``;
  each child runs ``echo hi`` the moment its line arrives.
* ``snapshot_creates`` - the client-side shape: ``create_snapshot`` of the parent, then 16
  concurrent SDK creates from it (``from_snapshot(use_extension=False)``), each answering as its
  create returns; a new snapshot per round (a fork's state is new each time), so standbys have
  not formed for it.
* ``paused_fork_stream`` - the streaming fork of a paused parent (on disk after its first fork).
* ``from_snapshot_standbys`` - ``POST /snapshots/{id}/sandboxes`` (``from_snapshot``) from one
  stored snapshot that earlier groups have given 16 standbys (an RL step's second and later
  groups from one start state); not a fork (no new state), listed for the comparison.

Between shapes the kills are waited for and the node left quiet (:data:`SETTLE_SECONDS`, plus
the standby refill of the last shape). ``FORKYARD_BENCH_FORK_STREAM_RUNS`` (default 3) rounds.

    .venv/bin/python -m bench --only fork_stream
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from bench.harness import ServerProcess, serve, stats
from forkyard_rl import Connection, Started, fork_stream, from_snapshot
from forkyard_rl.actions import bounded
from forkyard_rl.group import kill_quietly

COUNT = 16
LIFETIME = 600
#: Seconds of quiet after a shape's kills (network and disk release run in the background).
SETTLE_SECONDS = 4.0
#: Seconds for a snapshot's 16 standbys to refill after a group claimed them (16 restores here).
STANDBY_REFILL_SECONDS = 15.0
PREPARE = (
    "mkdir -p /home/user/work && cd /home/user/work && head -c 8388608 /dev/urandom > data.bin && "
    "python3 -m compileall -q /usr/lib/python3*/json >/dev/null 2>&1; (nohup sleep 3600 >/dev/null 2>&1 &)"
)


def _runs() -> int:
    return max(1, int(os.environ.get("FORKYARD_BENCH_FORK_STREAM_RUNS", "3")))


async def _answer(sandbox: Any) -> None:
    result = await sandbox.commands.run("echo hi")
    if result.stdout.strip() != "hi":
        raise RuntimeError(f"{sandbox.sandbox_id} answered {result.stdout!r}")


async def _timed_arrivals(arrivals: AsyncIterator[Started], start: float) -> tuple[float, float, list[Any]]:
    """Each sandbox answers a command as soon as it arrives: (first answering, all answering, sandboxes)."""
    answered: list[float] = []
    made: list[Any] = []
    work: list[asyncio.Task[None]] = []

    async def answer(sandbox: Any) -> None:
        await _answer(sandbox)
        answered.append(time.perf_counter() - start)

    async for started in arrivals:
        if started.sandbox is None:
            raise RuntimeError(f"a sandbox failed: {started.error}")
        made.append(started.sandbox)
        work.append(asyncio.ensure_future(answer(started.sandbox)))
    await asyncio.gather(*work)
    return min(answered), max(answered), made


async def _fork_call(parent: Any) -> tuple[float, float, list[Any]]:
    start = time.perf_counter()
    children = await parent.fork(count=COUNT, timeout=LIFETIME)
    failed = [c for c in children if isinstance(c, Exception)]
    if failed:
        raise RuntimeError(f"fork: {failed[0]}")
    answered: list[float] = []

    async def answer(sandbox: Any) -> None:
        await _answer(sandbox)
        answered.append(time.perf_counter() - start)

    await asyncio.gather(*(answer(c) for c in children))
    return min(answered), max(answered), list(children)


async def _fork_stream(parent: Any) -> tuple[float, float, list[Any]]:
    start = time.perf_counter()
    return await _timed_arrivals(fork_stream(parent, COUNT, lifetime=LIFETIME), start)


async def _snapshot_creates(parent: Any, conn: Connection) -> tuple[float, float, list[Any]]:
    start = time.perf_counter()
    snapshot = await parent.create_snapshot()
    arrivals = from_snapshot(
        snapshot.snapshot_id, COUNT, lifetime=LIFETIME, connection=conn, use_extension=False
    )
    try:
        return await _timed_arrivals(arrivals, start)
    finally:
        from e2b import AsyncSandbox

        await AsyncSandbox.delete_snapshot(snapshot.snapshot_id, **conn.opts())


async def _from_snapshot(snapshot_id: str, conn: Connection) -> tuple[float, float, list[Any]]:
    start = time.perf_counter()
    return await _timed_arrivals(from_snapshot(snapshot_id, COUNT, lifetime=LIFETIME, connection=conn), start)


async def _measure(server: ServerProcess, runs: int) -> dict[str, Any]:
    from e2b import AsyncSandbox

    conn = Connection(api_key=server.api_key, api_url=server.url, sandbox_url=server.url, request_timeout=300)
    opts = conn.opts()
    parent = await AsyncSandbox.create("base", timeout=3600, **opts)
    paused = await AsyncSandbox.create("base", timeout=3600, **opts)
    for sandbox in (parent, paused):
        await sandbox.commands.run(PREPARE)
    await paused.pause()
    stored = await parent.create_snapshot()
    samples: dict[str, dict[str, list[float]]] = {}

    async def one(name: str, shape: Callable[[], Awaitable[tuple[float, float, list[Any]]]]) -> None:
        first, last, made = await shape()
        await bounded(8, [lambda m=m: kill_quietly(m) for m in made])
        samples.setdefault(name, {"first": [], "all": []})
        samples[name]["first"].append(first)
        samples[name]["all"].append(last)
        print(f"fork_stream bench: {name}: first {first:.2f} s, all {last:.2f} s", flush=True)
        await asyncio.sleep(SETTLE_SECONDS)

    # Two groups from the stored snapshot first: its standbys form and grow to 16.
    for _ in range(2):
        _, _, made = await _from_snapshot(stored.snapshot_id, conn)
        await bounded(8, [lambda m=m: kill_quietly(m) for m in made])
        await asyncio.sleep(STANDBY_REFILL_SECONDS)
    shapes: list[tuple[str, Callable[[], Awaitable[tuple[float, float, list[Any]]]]]] = [
        ("fork_call", lambda: _fork_call(parent)),
        ("fork_stream", lambda: _fork_stream(parent)),
        ("snapshot_creates", lambda: _snapshot_creates(parent, conn)),
        ("paused_fork_stream", lambda: _fork_stream(paused)),
        ("from_snapshot_standbys", lambda: _from_snapshot(stored.snapshot_id, conn)),
    ]
    for round_ in range(runs):
        turn = shapes[round_ % len(shapes) :] + shapes[: round_ % len(shapes)]
        for name, shape in turn:
            await one(name, shape)
            if name == "from_snapshot_standbys":
                await asyncio.sleep(STANDBY_REFILL_SECONDS)
    for sandbox in (parent, paused):
        await kill_quietly(sandbox)
    await AsyncSandbox.delete_snapshot(stored.snapshot_id, **opts)
    return {
        name: {"first_answering": stats(s["first"]), "all_answering": stats(s["all"])}
        for name, s in samples.items()
    }


def run(runs: int = 0) -> dict[str, Any]:
    n = _runs()
    with serve() as server:
        result = asyncio.run(_measure(server, n))
    return {"count": COUNT, "rounds": n, "shapes": result}


def main() -> None:
    import json

    print(json.dumps(run(), indent=2))


if __name__ == "__main__":
    main()
