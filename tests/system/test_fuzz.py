"""A bounded fuzz run of the control plane from E2B's openapi.yml: no request may get a 5xx.

schemathesis (pinned in pyproject's ``test`` extra) generates requests for every operation of
``/work/shared/e2b-spec/openapi.yml`` (``AGENTENV_E2B_SPEC`` to point elsewhere), valid and
invalid ones (wrong types, missing fields, odd strings in paths, queries and headers), and
sends them to a real ``agentenv serve`` with the API key. Every answer must be below 500 (a
4xx in E2B's shape, or success). Derandomised: each run sends the same requests, so a failure
reproduces; ``AGENTENV_FUZZ_EXAMPLES`` (default 12) bounds the examples per operation.

The server has an empty template directory of its own, so nothing the fuzzer sends can start
a sandbox or a build from the shared cache, or delete a template in it (``DELETE
/templates/{id}`` with a lucky ``base``). Excluded operations: none. Every operation is
called; those we do not implement answer 404/405/501 and are held to the same rule.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
from hypothesis import HealthCheck, settings  # noqa: E402 - only once schemathesis is there

from tests.support.server import ServerProcess, serve  # noqa: E402

SPEC = Path(os.environ.get("AGENTENV_E2B_SPEC", "/work/shared/e2b-spec/openapi.yml"))
EXAMPLES = int(os.environ.get("AGENTENV_FUZZ_EXAMPLES", "12"))

pytestmark = pytest.mark.requires_root("runs a real agentenv server")

if not SPEC.exists():
    pytest.skip(f"E2B's openapi.yml is not at {SPEC} (set AGENTENV_E2B_SPEC)", allow_module_level=True)

schema = schemathesis.openapi.from_path(SPEC)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    with (
        tempfile.TemporaryDirectory(prefix="agentenv-fuzz-templates-") as templates,
        serve(prefix="agentenv-fuzz-", extra_env={"AGENTENV_TEMPLATES_PATH": templates}) as server,
    ):
        yield server


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case: schemathesis.Case, fuzz_server: ServerProcess) -> None:
    response = case.call(base_url=fuzz_server.url, headers={"X-API-Key": fuzz_server.api_key}, timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}\n"
        f"reproduce: {case.as_curl_command()}"
    )
