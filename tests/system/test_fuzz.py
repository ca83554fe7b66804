"""A bounded fuzz run of the control plane from E2B's openapi.yml: no request may get a 5xx.

schemathesis (pinned in pyproject's ``test`` extra) generates requests for every operation of
``/work/shared/e2b-spec/openapi.yml`` (``FORKYARD_E2B_SPEC`` to point elsewhere), valid and
invalid ones (wrong types, missing fields, odd strings in paths, queries and headers), and
sends them to a real ``forkyard serve`` with the API key. Every answer must be below 500 (a
4xx in E2B's shape, or success). Derandomised: each run sends the same requests, so a failure
reproduces; ``FORKYARD_FUZZ_EXAMPLES`` (default 12) bounds the examples per operation.

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

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
from hypothesis import HealthCheck, settings  # noqa: E402 - only once schemathesis is there

from tests.support.server import ServerProcess, serve  # noqa: E402

SPEC = Path(os.environ.get("FORKYARD_E2B_SPEC", "/work/shared/e2b-spec/openapi.yml"))
EXAMPLES = int(os.environ.get("FORKYARD_FUZZ_EXAMPLES", "12"))

pytestmark = pytest.mark.requires_root("runs a real forkyard server")

if not SPEC.exists():
    pytest.skip(f"E2B's openapi.yml is not at {SPEC} (set FORKYARD_E2B_SPEC)", allow_module_level=True)

schema = schemathesis.openapi.from_path(SPEC)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    with (
        tempfile.TemporaryDirectory(prefix="forkyard-fuzz-templates-") as templates,
        serve(prefix="forkyard-fuzz-", extra_env={"FORKYARD_TEMPLATES_PATH": templates}) as server,
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


# --- the cases issue 15 named, one by one -------------------------------------------------------
def _post(server: ServerProcess, path: str, **kwargs: object) -> httpx.Response:
    headers = {"X-API-Key": server.api_key, **kwargs.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)  # type: ignore[arg-type]


def test_non_ascii_port_header_is_a_400(fuzz_server: ServerProcess) -> None:
    # "²" as the one latin-1 byte a client sends for it (str.isdigit took it, int() did not).
    for port in (b"\xb2", "٤٩٩٨٣".encode(), b"-1", b"99999"):
        response = httpx.get(
            fuzz_server.url + "/health",
            headers={"E2b-Sandbox-Id": b"abc", "E2b-Sandbox-Port": port},
            timeout=30,
        )
        assert response.status_code == 400, (port, response.text)
        assert set(response.json()) >= {"code", "message"}  # the proxy adds sandboxId, as E2B's


def test_oversized_bodies_and_metadata_are_refused(fuzz_server: ServerProcess) -> None:
    # 10 MiB of metadata was accepted and stored: over the metadata limit, a 400 in E2B's shape.
    big = {"templateID": "base", "metadata": {"k": "v" * (10 << 20)}}
    response = _post(fuzz_server, "/sandboxes", json=big)
    assert response.status_code == 400 and "metadata" in response.json()["message"], response.text[:300]
    # Over E2B's 16 MiB request limit: 413 before any route reads it, declared or chunked.
    body = b'{"templateID": "base", "x": "' + b"y" * (17 << 20) + b'"}'
    response = _post(fuzz_server, "/sandboxes", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text[:300]
    chunked = _post(
        fuzz_server,
        "/sandboxes",
        content=iter([body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]),
    )
    assert chunked.status_code == 413, chunked.text[:300]
    assert response.json()["code"] == 413
    # Within the limits the request goes through to the route (no such template here).
    small = _post(fuzz_server, "/sandboxes", json={"templateID": "base", "metadata": {"k": "v" * 1000}})
    assert small.status_code == 404, small.text[:300]
