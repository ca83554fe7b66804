"""E2B's code interpreter (``code-interpreter-v1``, the published ``e2b-code-interpreter`` SDK),
each row beside its ``base`` baseline from the same server and run:

- ``create_to_first_result``: ``Sandbox.create()`` -> the first ``run_code("1+1")`` result
  (baseline: ``base`` create -> first ``commands.run("echo hi")``);
- ``run_code_round_trip``: ``run_code("1+1")`` on a running sandbox (baseline: ``commands.run("true")``);
- ``matplotlib_chart``: a cell drawing a line chart, returning PNG + chart data (pyplot imported
  by an earlier cell, as in a notebook);
- ``idle_pss_mib``: host memory (PSS, as bench/density.py) per idle sandbox after one call,
  code interpreter vs base.

Both templates are pooled (``FORKYARD_WARM_POOL_TEMPLATES``): a create is a pool claim when the
pool has refilled since the previous one (the bench waits for the refill between creates) and
the template's snapshot holds the server with a warm Python kernel.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any

from bench.density import MIB, host_memory
from bench.harness import serve, stats, timed, write_result
from bench.lifecycle import ServerDatabase

TEMPLATE = "code-interpreter-v1"
CHART_CELL = "plt.plot([1, 2, 3, 4], [4, 1, 3, 2])\nplt.title('bench')\nplt.show()"
IDLE_SANDBOXES = 3
IDLE_SECONDS = 5.0
POOL_WAIT_SECONDS = 300.0
TARGETS_MS = {"create_to_first_result": 150, "run_code_round_trip": 25, "matplotlib_chart": 400}


def _pooled(server: Any, database: ServerDatabase, template: str) -> int:
    """Sandboxes the pool of ``template`` announced that no create claimed yet."""
    log = server.log_path.read_text(errors="replace")
    announced = re.findall(rf"warm pool \S*{re.escape(template)}\S*: (\S+) ready in", log)
    return len(set(announced) - database.sandbox_ids())


def _wait_pool(server: Any, database: ServerDatabase, template: str) -> None:
    """Until the pool of ``template`` holds a sandbox (a claim below the low mark refills it)."""
    deadline = time.monotonic() + POOL_WAIT_SECONDS
    while _pooled(server, database, template) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm pool of {template} held nothing for {POOL_WAIT_SECONDS:.0f} s")
        time.sleep(0.05)
    time.sleep(1.5)  # a refill's restore leaves the cores (FORKYARD_POOL_REFILL_QUIET_MS)


def run(runs: int) -> dict[str, Any]:
    from e2b import Sandbox as BaseSandbox
    from e2b_code_interpreter import Sandbox

    env = {
        "FORKYARD_WARM_POOL_TEMPLATES": json.dumps(["base", TEMPLATE]),
        "FORKYARD_BUILD_CODE_INTERPRETER": "false",
    }
    samples: dict[str, list[float]] = {k: [] for k in ("create_to_first_result", "create_to_first_echo")}
    samples |= {"run_code_round_trip": [], "commands_run_true": [], "matplotlib_chart": []}
    origins: list[str] = []
    errors: list[str] = []
    creates = max(5, runs // 2)
    with serve(extra_env=env) as server:
        opts = server.sdk_opts
        database = ServerDatabase(server.data_dir)
        for template in ("base", TEMPLATE):
            _wait_pool(server, database, template)
        for i in range(creates):
            started = time.perf_counter()
            sbx = Sandbox.create(timeout=300, **opts)
            first = sbx.run_code("1+1")
            samples["create_to_first_result"].append(time.perf_counter() - started)
            origins.append(str(database.sandbox(sbx.sandbox_id).get("origin")))
            if first.text != "2":
                errors.append(f"run {i}: 1+1 gave {first.text!r} ({first.error})")
            if i == 0:
                sbx.run_code("import matplotlib.pyplot as plt")
                for _ in range(runs):
                    samples["run_code_round_trip"].append(timed(lambda s=sbx: s.run_code("1+1")))
                for _ in range(runs):
                    samples["matplotlib_chart"].append(timed(lambda s=sbx: _chart(s, errors)))
            sbx.kill()
            _wait_pool(server, database, TEMPLATE)
            started = time.perf_counter()
            base = BaseSandbox.create("base", timeout=300, **opts)
            base.commands.run("echo hi")
            samples["create_to_first_echo"].append(time.perf_counter() - started)
            if i == 0:
                for _ in range(runs):
                    samples["commands_run_true"].append(timed(lambda b=base: b.commands.run("true")))
            base.kill()
            _wait_pool(server, database, "base")
        memory = _idle_memory(Sandbox, BaseSandbox, opts)
    result: dict[str, Any] = {name: stats(values) for name, values in samples.items()}
    result["idle_pss_mib"] = memory
    result["targets"] = _targets(result, memory)
    result["create_origins"] = dict((o, origins.count(o)) for o in sorted(set(origins)))
    result["errors"] = errors
    result["notes"] = (
        "one server, warm pools of base and code-interpreter-v1; create rows: a pool claim each "
        "(the bench waits for the refill between creates); round trips on one sandbox; PSS: sum "
        "over the sandbox's host processes after one call and 5 s idle (bench/density.py)."
    )
    return result


def _chart(sbx: Any, errors: list[str]) -> None:
    execution = sbx.run_code(CHART_CELL)
    figure = execution.results[0] if execution.results else None
    if figure is None or not figure.png or figure.chart is None:
        errors.append(f"chart cell: {execution}")


def _idle_memory(sandbox_cls: Any, base_cls: Any, opts: dict[str, str]) -> dict[str, Any]:
    made: list[tuple[str, Any]] = []
    try:
        for _ in range(IDLE_SANDBOXES):
            sbx = sandbox_cls.create(timeout=300, **opts)
            sbx.run_code("1+1")
            made.append(("code_interpreter", sbx))
            base = base_cls.create("base", timeout=300, **opts)
            base.commands.run("echo hi")
            made.append(("base", base))
        time.sleep(IDLE_SECONDS)
        pss: dict[str, list[float]] = {"code_interpreter": [], "base": []}
        for kind, sbx in made:
            pss[kind].append(host_memory(sbx.sandbox_id)["pss"] / MIB)
    finally:
        for _, sbx in made:
            sbx.kill()
    p50 = {kind: sorted(values)[len(values) // 2] for kind, values in pss.items()}
    return {
        "code_interpreter_p50": round(p50["code_interpreter"], 1),
        "base_p50": round(p50["base"], 1),
        "ratio": round(p50["code_interpreter"] / p50["base"], 2) if p50["base"] else None,
        "samples": {k: [round(v, 1) for v in vals] for k, vals in pss.items()},
    }


def _targets(result: dict[str, Any], memory: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    baselines = {
        "create_to_first_result": "create_to_first_echo",
        "run_code_round_trip": "commands_run_true",
        "matplotlib_chart": "run_code_round_trip",
    }
    for name, target in TARGETS_MS.items():
        p50 = result[name].get("p50_ms")
        rows.append(
            {
                "measurement": name,
                "target": f"< {target} ms p50",
                "p50_ms": p50,
                "baseline": baselines[name],
                "baseline_p50_ms": result[baselines[name]].get("p50_ms"),
                "met": p50 is not None and p50 < target,
            }
        )
    ratio = memory.get("ratio")
    rows.append(
        {
            "measurement": "idle PSS vs base",
            "target": "<= 2x",
            "ratio": ratio,
            "met": bool(ratio and ratio <= 2),
        }
    )
    return rows


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    result = run(runs)
    path = write_result("code_interpreter", result)
    print(json.dumps({k: v for k, v in result.items() if k != "notes"}, indent=2), "\n->", path)


if __name__ == "__main__":
    main()
