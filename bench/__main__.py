"""`make bench`: every benchmark against a real server, results in bench/results/*.json and a
summary table in bench/results/SUMMARY.md (copied into README between its bench markers)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
from pathlib import Path

from bench import core
from bench.harness import REPO, RESULTS, serve, write_result


def _rows(prefix: str, data: object) -> list[str]:
    rows: list[str] = []
    if isinstance(data, dict):
        if "p50_ms" in data:
            cells = [data["n"], data["p50_ms"], data["p95_ms"], data["max_ms"]]
            rows.append(f"| {prefix} | " + " | ".join(str(c) for c in cells) + " |")
        else:
            for key, value in data.items():
                rows.extend(_rows(f"{prefix} / {key}" if prefix else key, value))
    return rows


def summarise(results: dict[str, dict[str, object]]) -> str:
    lines = ["| measurement | n | p50 ms | p95 ms | max ms |", "| --- | --- | --- | --- | --- |"]
    for name, payload in results.items():
        lines.extend(_rows(name, payload))
    for name, payload in results.items():
        for key, value in payload.items():
            if not isinstance(value, dict | list):
                lines.append(f"\n{name} / {key}: **{value}**")
    return "\n".join(lines) + "\n"


def _measurements(payload: dict[str, object]) -> dict[str, object]:
    """A result file without its bookkeeping fields."""
    return {k: v for k, v in payload.items() if k not in ("benchmark", "recorded_at", "errors")}


def update_readme(summary: str) -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    pattern = re.compile(r"(<!-- bench:start -->\n).*?(<!-- bench:end -->)", re.S)
    if pattern.search(text):
        readme.write_text(pattern.sub(lambda m: m.group(1) + summary + m.group(2), text))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--runs", type=int, default=20, help="repetitions per measurement (>= 20 for p95)")
    parser.add_argument("--only", choices=["core", "lifecycle", "runtimes"], action="append")
    args = parser.parse_args()
    templates = Path(os.environ.get("AGENTENV_TEMPLATES_PATH", "/var/lib/agentenv/templates"))
    wanted = set(args.only or ["core", "lifecycle", "runtimes"])
    results: dict[str, dict[str, object]] = {}

    with serve() as server:
        if "core" in wanted:
            results["core"] = core.run(server, args.runs, templates)
            write_result("core", results["core"])
        # Lifecycle (pause/snapshot/fork) and runtime comparison live in their own modules.
        for name in ("lifecycle", "runtimes"):
            if name not in wanted:
                continue
            try:
                module = importlib.import_module(f"bench.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"bench.{name}":
                    raise
                print(f"bench: {name} benchmark not present, skipped")
                continue
            if name == "lifecycle":
                results[name] = module.run(server.url, server.api_key, args.runs, server.log_path)
            else:
                results[name] = module.run(server.url, server.api_key, args.runs)
            write_result(name, results[name])

    # The summary covers every recorded benchmark, also those not re-run this time.
    recorded = {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}
    summary = summarise({name: _measurements(payload) for name, payload in recorded.items()})
    (RESULTS / "SUMMARY.md").write_text(summary)
    update_readme(summary)
    print(summary)
    print(json.dumps({k: str(RESULTS / f"{k}.json") for k in results}, indent=2))


if __name__ == "__main__":
    main()
