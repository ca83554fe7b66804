"""E2B's own CLI (npm ``@e2b/cli``, pinned in tests/js/package.json) against a real server:
``e2b sandbox logs`` parses every v1 log line as a JSON record and reads its ``level`` and
``logger`` (it crashed on plain text lines), prints them pretty or as JSON, and filters them by
level and logger.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from tests.support import TESTS
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("sandboxes")

CLI = TESTS / "js" / "node_modules" / "@e2b" / "cli" / "dist" / "index.js"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if shutil.which("node") is None or not CLI.is_file():
        pytest.fail("node or @e2b/cli missing (scripts/bootstrap.sh --test installs tests/js)")
    with serve(prefix="forkyard-e2bcli-") as srv:
        yield srv


def _e2b(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **server.sdk_env, "NO_UPDATE_NOTIFIER": "1", "NO_COLOR": "1"}
    return subprocess.run(
        ["node", str(CLI), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_sandbox_logs_pretty_json_and_filters(server: ServerProcess) -> None:
    sbx = Sandbox.create(**server.sdk_opts)
    try:
        sbx.commands.run("echo hi")
        pretty = _e2b(server, "sandbox", "logs", sbx.sandbox_id)
        assert pretty.returncode == 0, pretty.stderr
        assert f"Logs for sandbox {sbx.sandbox_id}" in pretty.stdout
        plain = re.sub(r"\x1b\[[0-9;]*m", "", pretty.stdout)  # util.inspect colours the fields
        assert "] INFO " in plain and "logger: 'orchestrator'" in plain
        as_json = _e2b(server, "sandbox", "logs", sbx.sandbox_id, "--format", "json")
        assert as_json.returncode == 0, as_json.stderr
        records = [json.loads(line) for line in as_json.stdout.splitlines() if line.startswith("{")]
        assert records and all(r["level"] in ("debug", "info", "warn", "error") for r in records)
        assert any(r["logger"] == "orchestrator" and r["message"].startswith("sandbox ") for r in records)
        # The CLI's --loggers keeps the records of the loggers named; --level ERROR drops info.
        envd_only = _e2b(server, "sandbox", "logs", sbx.sandbox_id, "--format", "json", "--loggers", "envd")
        assert envd_only.returncode == 0, envd_only.stderr
        loggers = {json.loads(ln)["logger"] for ln in envd_only.stdout.splitlines() if ln.startswith("{")}
        assert loggers <= {"envd"}
        errors = _e2b(server, "sandbox", "logs", sbx.sandbox_id, "--format", "json", "--level", "ERROR")
        assert errors.returncode == 0 and not [ln for ln in errors.stdout.splitlines() if ln.startswith("{")]
    finally:
        sbx.kill()
