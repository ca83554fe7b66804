"""SWE-style RL rollouts (issue 26, part 5): a prepared repository, then groups of rollouts that
each apply a patch and run the tests, forked from the prepared state against fresh sandboxes that
redo the preparation, on a real server with production settings.

* preparation (:func:`_prepare`): a git repository of ~3,000 files (2,000 modules in 40 packages,
  40 test files, 1,000 data files) written and committed inside the sandbox; its Python
  dependencies (pytest and its requirements, attrs) installed with pip from a local wheelhouse
  (wheels built on the host once with ``pip wheel``, copied in through the files API; no index);
  one test file run to warm the caches (imports, ``__pycache__``, pytest's cache).
* rollout (:data:`ROLLOUT`): ``git apply`` of a patch (a changed module and a new test; a third of
  them break a test, as model patches do) and the tests of two packages (~100 modules); a rollout
  counts when pytest ran (exit 0 or 1).
* ``fork_g<G>``: the prepared sandbox stays running; rollouts come in groups of G, each group one
  streaming fork (``forkyard_rl.fork_stream``: a rollout starts when its own child answers), at
  most :data:`IN_FLIGHT` rollouts at once (16 // G groups).
* ``paused_fork_g<G>``: the same from the prepared sandbox paused (forks without a resume).
* ``fresh``: each rollout a create from ``base``, the whole preparation, the rollout,
  :data:`IN_FLIGHT` at a time.

Per rollout: from its group's fork request (fresh: its create) to its tests' end. Total wall: the
rollouts of a side, plus for the fork sides the one preparation they stand on (and the pause).
``FORKYARD_BENCH_RL_SWE_COUNT`` (default 64) rollouts per side.

    .venv/bin/python -m bench --only rl_swe
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.harness import ServerProcess, serve, stats
from forkyard_rl import Connection, fork_stream
from forkyard_rl.actions import bounded
from forkyard_rl.group import kill_quietly

GROUPS = (16, 8)
IN_FLIGHT = 16
LIFETIME = 1800
WHEELHOUSE = Path("/tmp/forkyard-bench-wheelhouse")
#: What the wheelhouse holds (and pip installs from it, offline).
REQUIREMENTS = ("pytest==9.0.3", "attrs==25.4.0")
HOME = "/home/user"
REPO = f"{HOME}/repo"
DEPS = f"{HOME}/deps"
#: Writes the repository: packages of modules, their tests, data files; then one commit.
MAKE_REPO = r"""
import os, sys
root = sys.argv[1]
for sub in ("proj", "tests", "data"):
    os.makedirs(os.path.join(root, sub), exist_ok=True)
open(os.path.join(root, "proj", "__init__.py"), "w").close()
with open(os.path.join(root, ".gitignore"), "w") as f:
    f.write("__pycache__/\n.pytest_cache/\n")
for p in range(40):
    pkg = os.path.join(root, "proj", f"pkg_{p}")
    os.makedirs(pkg, exist_ok=True)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for m in range(50):
        with open(os.path.join(pkg, f"mod_{m}.py"), "w") as f:
            f.write(f"def value(x):\n    return x * {m + 1} + {p}\n\n\nNAME = 'pkg_{p}.mod_{m}'\n")
    with open(os.path.join(root, "tests", f"test_pkg_{p}.py"), "w") as f:
        f.write("import importlib\n\nimport pytest\n\n\n@pytest.mark.parametrize('m', range(50))\n")
        f.write(f"def test_value(m):\n    mod = importlib.import_module(f'proj.pkg_{p}.mod_{{m}}')\n")
        f.write(f"    assert mod.value(2) == 2 * (m + 1) + {p}\n")
for d in range(1000):
    with open(os.path.join(root, "data", f"sample_{d}.txt"), "w") as f:
        f.write(f"sample {d}\n" * 20)
"""
PREPARE = (
    f"set -e; mkdir -p {REPO} {DEPS} && cd {REPO} && python3 {HOME}/make_repo.py {REPO} && "
    "git init -q && git add -A && git -c user.email=b@e.nch -c user.name=bench commit -qm initial && "
    f"python3 -m pip install -q --no-index --find-links {HOME}/wheelhouse --target {DEPS} "
    f"--break-system-packages {' '.join(REQUIREMENTS)} && "
    f"PYTHONPATH={DEPS}:{REPO} python3 -m pytest -q tests/test_pkg_0.py >/dev/null && "
    "git status --short | wc -l"
)


def _rollout(i: int) -> str:
    """Rollout ``i``'s patch and tests: a changed module (every third one breaks a test) and a new
    test, applied with ``git apply``; the tests of the patched package and one other."""
    p, m = i % 40, i % 50
    new = f"{p} + x * {m + 1}" if i % 3 else f"x * {m + 2} + {p}"
    patch = (
        f"--- a/proj/pkg_{p}/mod_{m}.py\n+++ b/proj/pkg_{p}/mod_{m}.py\n@@ -1,5 +1,5 @@\n"
        f" def value(x):\n-    return x * {m + 1} + {p}\n+    return {new}\n \n \n NAME = 'pkg_{p}.mod_{m}'\n"
        f"--- /dev/null\n+++ b/tests/test_rollout.py\n@@ -0,0 +1,2 @@\n"
        f"+def test_rollout():\n+    assert {i} >= 0\n"
    )
    tests = f"tests/test_pkg_{p}.py tests/test_pkg_{(p + 1) % 40}.py tests/test_rollout.py"
    return (
        f"cd {REPO} && cat > /tmp/rollout.patch <<'PATCH'\n{patch}PATCH\n"
        f"git apply /tmp/rollout.patch && PYTHONPATH={DEPS}:{REPO} python3 -m pytest -q {tests}"
    )


def _count() -> int:
    return max(1, int(os.environ.get("FORKYARD_BENCH_RL_SWE_COUNT", "64")))


def wheelhouse() -> list[Path]:
    """The wheels of :data:`REQUIREMENTS` and their dependencies, built on the host once."""
    wheels = sorted(WHEELHOUSE.glob("*.whl"))
    if not wheels:
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(WHEELHOUSE), *REQUIREMENTS], check=True
        )
        wheels = sorted(WHEELHOUSE.glob("*.whl"))
    return wheels


async def _prepare(sandbox: Any, wheels: list[Path]) -> float:
    """The whole preparation in ``sandbox``: its wall seconds."""
    t = time.perf_counter()
    await sandbox.files.write(f"{HOME}/make_repo.py", MAKE_REPO)
    for wheel in wheels:
        await sandbox.files.write(f"{HOME}/wheelhouse/{wheel.name}", wheel.read_bytes())
    result = await sandbox.commands.run(PREPARE, timeout=900)
    if result.exit_code != 0 or result.stdout.strip() != "0":
        raise RuntimeError(f"preparation: {result.exit_code} {result.stdout[-300:]} {result.stderr[-500:]}")
    return time.perf_counter() - t


async def _run_rollout(sandbox: Any, i: int) -> None:
    from e2b import CommandExitException

    try:
        await sandbox.commands.run(_rollout(i), timeout=600)
    except CommandExitException as exc:
        if exc.exit_code != 1:  # 1: tests ran, some failed (the patch broke them)
            raise RuntimeError(f"rollout {i}: exit {exc.exit_code}: {exc.stderr[-500:]}") from exc


async def _fork_side(parent: Any, n: int, group: int) -> dict[str, Any]:
    per_rollout: list[float] = []
    started = time.perf_counter()

    async def one_group(first: int) -> None:
        t = time.perf_counter()
        work: list[asyncio.Task[None]] = []

        async def rollout(sandbox: Any, i: int) -> None:
            try:
                await _run_rollout(sandbox, i)
                per_rollout.append(time.perf_counter() - t)
            finally:
                await kill_quietly(sandbox)

        size = min(group, n - first)
        async for arrived in fork_stream(parent, size, lifetime=LIFETIME):
            if arrived.sandbox is None:
                raise RuntimeError(f"a child failed: {arrived.error}")
            work.append(asyncio.ensure_future(rollout(arrived.sandbox, first + len(work))))
        await asyncio.gather(*work)

    await bounded(max(1, IN_FLIGHT // group), [lambda f=f: one_group(f) for f in range(0, n, group)])
    return {"per_rollout": stats(per_rollout), "rollouts_wall_s": round(time.perf_counter() - started, 2)}


async def _fresh_side(n: int, conn: Connection, wheels: list[Path]) -> dict[str, Any]:
    from e2b import AsyncSandbox

    per_rollout: list[float] = []
    preparations: list[float] = []
    started = time.perf_counter()

    async def rollout(i: int) -> None:
        t = time.perf_counter()
        sandbox = await AsyncSandbox.create("base", timeout=LIFETIME, **conn.opts())
        try:
            preparations.append(await _prepare(sandbox, wheels))
            await _run_rollout(sandbox, i)
            per_rollout.append(time.perf_counter() - t)
        finally:
            await kill_quietly(sandbox)

    await bounded(IN_FLIGHT, [lambda i=i: rollout(i) for i in range(n)])
    return {
        "per_rollout": stats(per_rollout),
        "preparation": stats(preparations),
        "total_wall_s": round(time.perf_counter() - started, 2),
    }


async def _measure(server: ServerProcess, n: int) -> dict[str, Any]:
    from e2b import AsyncSandbox

    wheels = await asyncio.to_thread(wheelhouse)
    conn = Connection(api_key=server.api_key, api_url=server.url, sandbox_url=server.url, request_timeout=600)
    result: dict[str, Any] = {}
    t = time.perf_counter()
    parent = await AsyncSandbox.create("base", timeout=LIFETIME, **conn.opts())
    preparation = await _prepare(parent, wheels)
    made = time.perf_counter() - t
    result["preparation_once_s"] = round(preparation, 2)
    sides: list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]] = [
        (f"fork_g{g}", lambda g=g: _fork_side(parent, n, g)) for g in GROUPS
    ]
    for name, side in sides:
        result[name] = await side()
        result[name]["total_wall_s"] = round(made + result[name]["rollouts_wall_s"], 2)
        print(f"rl_swe bench: {name}: {result[name]}", flush=True)
    t = time.perf_counter()
    await parent.pause()
    paused = time.perf_counter() - t
    for g in GROUPS:
        name = f"paused_fork_g{g}"
        result[name] = await _fork_side(parent, n, g)
        result[name]["total_wall_s"] = round(made + paused + result[name]["rollouts_wall_s"], 2)
        print(f"rl_swe bench: {name}: {result[name]}", flush=True)
    await kill_quietly(parent)
    result["fresh"] = await _fresh_side(n, conn, wheels)
    print(f"rl_swe bench: fresh: {result['fresh']}", flush=True)
    return result


def run(runs: int = 0) -> dict[str, Any]:
    """``runs`` is not used: N is ``FORKYARD_BENCH_RL_SWE_COUNT`` (one rollout each)."""
    n = _count()
    with serve() as server:
        result = asyncio.run(_measure(server, n))
    fresh = result["fresh"]
    ratios = {}
    for name in [k for k in result if "fork_g" in k]:
        ratios[f"{name}_vs_fresh_total_wall"] = round(fresh["total_wall_s"] / result[name]["total_wall_s"], 2)
        ratios[f"{name}_vs_fresh_p50_per_rollout"] = round(
            fresh["per_rollout"]["p50_ms"] / result[name]["per_rollout"]["p50_ms"], 2
        )
    return {"rollouts": n, **result, **ratios}


def main() -> None:
    import json

    from bench.harness import write_result

    result = run()
    print(write_result("rl_swe", result))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
