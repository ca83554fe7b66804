"""RL rollouts (issue 13): N one-step rollouts via fork from a prepared state vs N fresh creates
that each redo the preparation, through forkyard_rl and the official SDK, on a real server with
production settings (warm pool on).

* fork: one sandbox of ``base`` is prepared once (:data:`PREPARE`); then N children are forked
  from it in groups of :data:`FORK_BATCH` (the batches run concurrently, the server serialises
  their checkpoints of the parent) and each runs :data:`STEP` once. Per rollout: its batch's
  fork call (from the call's start: the wait for the parent's lock counts) + its step.
* fresh: N rollouts, at most :data:`CONCURRENCY` at a time, each a create from ``base``, the
  preparation and the step. Per rollout: create + preparation + step.

Total wall: the first request to the last step's answer (the fork side includes the one
preparation and the root's create). ``FORKYARD_BENCH_RL_COUNT`` (default 64) sets N.

    .venv/bin/python -m bench --only rl
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial
from typing import Any

from bench.harness import ServerProcess, serve, stats
from forkyard_rl import Connection, ForkTree, RunResult, run_action
from forkyard_rl.actions import bounded
from forkyard_rl.group import kill_quietly

#: The prepared state: data on disk, a byte-compiled module, and a process in memory (~1-2 s
#: inside a sandbox here), the kind of set-up a task repeats per episode without forks.
PREPARE = (
    "mkdir -p /home/user/work && cd /home/user/work && "
    "head -c 16777216 /dev/urandom > data.bin && "
    "sha256sum data.bin > digest && "
    "printf 'def score(x):\\n    return sum(i * i for i in range(x)) %% 97\\n' > task.py && "
    "python3 -m compileall -q . && "
    "python3 -c 'import task; print(sum(task.score(i) for i in range(2000)))' > baseline && "
    "(nohup sleep 3600 >/dev/null 2>&1 &)"
)
#: The one step of a rollout: reads the prepared state and answers.
STEP = "cd /home/user/work && python3 -c 'import task; print(task.score(1000))' && test -s digest"
FORK_BATCH = 16
CONCURRENCY = 16
LIFETIME = 900


def _count() -> int:
    return max(1, int(os.environ.get("FORKYARD_BENCH_RL_COUNT", "64")))


def _check(result: RunResult, what: str) -> RunResult:
    if not result.ok:
        raise RuntimeError(
            f"{what} failed in {result.sandbox_id}: {result.exit_code} {result.error} {result.stderr}"
        )
    return result


async def _fork_side(n: int, conn: Connection) -> dict[str, Any]:
    started = time.perf_counter()
    per_rollout: list[float] = []
    fork_calls: list[float] = []
    async with await ForkTree.create(
        "base", lifetime=LIFETIME, connection=conn, concurrency=CONCURRENCY
    ) as tree:
        prepare = _check((await tree.run([tree.root], PREPARE, command_timeout=300))[0], "preparation")

        async def batch(size: int) -> None:
            t = time.perf_counter()
            children = await tree.fork(tree.root, size, lifetime=LIFETIME)
            forked = time.perf_counter() - t
            fork_calls.append(forked)
            steps = await tree.run(children, STEP, command_timeout=120)
            per_rollout.extend(forked + _check(s, "step").duration_s for s in steps)
            await tree.prune_all(children)

        sizes = [min(FORK_BATCH, n - i) for i in range(0, n, FORK_BATCH)]
        await bounded(len(sizes), [partial(batch, s) for s in sizes])
        wall = time.perf_counter() - started
    return {
        "per_rollout": stats(per_rollout),
        "fork_call": stats(fork_calls),
        "preparation_once": stats([prepare.duration_s]),
        "total_wall_s": round(wall, 2),
    }


async def _fresh_side(n: int, conn: Connection) -> dict[str, Any]:
    from e2b import AsyncSandbox

    started = time.perf_counter()
    per_rollout: list[float] = []
    preparations: list[float] = []

    async def rollout() -> None:
        t = time.perf_counter()
        sbx = await AsyncSandbox.create("base", timeout=LIFETIME, **conn.opts())
        try:
            prep = _check(await run_action(sbx, PREPARE, command_timeout=300), "preparation")
            _check(await run_action(sbx, STEP, command_timeout=120), "step")
            per_rollout.append(time.perf_counter() - t)
            preparations.append(prep.duration_s)
        finally:
            await kill_quietly(sbx)

    await bounded(CONCURRENCY, [rollout] * n)
    return {
        "per_rollout": stats(per_rollout),
        "preparation": stats(preparations),
        "total_wall_s": round(time.perf_counter() - started, 2),
    }


def measure(server: ServerProcess, n: int) -> dict[str, Any]:
    conn = Connection(api_key=server.api_key, api_url=server.url, sandbox_url=server.url, request_timeout=600)
    fork = asyncio.run(_fork_side(n, conn))
    fresh = asyncio.run(_fresh_side(n, conn))
    return {"fork": fork, "fresh": fresh}


def run(runs: int = 0) -> dict[str, Any]:
    """``runs`` is not used: N is ``FORKYARD_BENCH_RL_COUNT`` (one rollout each)."""
    n = _count()
    with serve() as server:
        result = measure(server, n)
    fork, fresh = result["fork"], result["fresh"]
    return {
        "rollouts": n,
        **result,
        # Top-level scalars are what the summary table prints.
        "fork_total_wall_s": fork["total_wall_s"],
        "fresh_total_wall_s": fresh["total_wall_s"],
        "fork_vs_fresh_total_wall": round(fresh["total_wall_s"] / fork["total_wall_s"], 2),
        "fork_vs_fresh_p50_per_rollout": round(
            fresh["per_rollout"]["p50_ms"] / fork["per_rollout"]["p50_ms"], 2
        ),
        "notes": f"{n} one-step rollouts. fork: one prepared base sandbox, children forked in batches "
        f"of {FORK_BATCH} (concurrent calls), per rollout = its batch's fork call + its step. fresh: create "
        f"+ preparation + step per rollout, {CONCURRENCY} at a time. Production server settings.",
    }


def main() -> None:
    import json

    print(json.dumps(run(), indent=2))


if __name__ == "__main__":
    main()
