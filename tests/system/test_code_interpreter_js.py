"""E2B's code interpreter through the published JS SDK (npm ``@e2b/code-interpreter``,
tests/js/package.json; tests/js/code_interpreter.mjs) against a real ``forkyard serve``."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.support import TESTS
from tests.support.server import ServerProcess, serve
from tests.system.test_code_interpreter import code_interpreter_missing

pytestmark = pytest.mark.requires_root("code-interpreter sandboxes are real gVisor sandboxes")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    reason = code_interpreter_missing()
    if reason:
        pytest.skip(reason)
    with serve(prefix="forkyard-cijs-") as srv:
        yield srv


def test_js_code_interpreter_sdk(server: ServerProcess) -> None:
    proc = subprocess.run(
        ["node", "code_interpreter.mjs"],
        cwd=TESTS / "js",
        env={**os.environ, **server.sdk_env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({k: out[k] for k in ("createMs", "firstRunMs")}))
    assert out["text"] == "2" and isinstance(out["executionCount"], int)
    assert out["stdout"] == "js-out\n" and out["stderr"] == "js-err\n" and out["onStdout"] == "js-out\n"
    assert out["error"] == {"name": "KeyError", "value": "'missing'", "hasTraceback": True}
    assert out["chart"]["type"] == "bar" and out["chart"]["title"] == "bars" and out["chart"]["png"]
    assert "png" in out["chart"]["formats"]  # the JS SDK's formats() never lists "chart"
    assert out["data"] == {"columns": ["a"], "index": [0], "data": [[1]]}
    assert out["envs"] == ["'sandbox'", "'cell'", "'sandbox'"]
    assert out["context"] == {"language": "python", "cwd": "/tmp"} and out["contextCwd"] == "'/tmp'"
    assert out["listed"] is True and out["listedAfterRemove"] is False
    assert out["js"] == "42" and out["ts"] == "42" and out["bash"] == "bash-42"
    assert out["jsValue"] == {"text": "2", "main": [True], "stdout": []}  # E2B's: the value is the result
    assert out["timeout"] == "TimeoutError"
    assert out["afterTimeout"] == "'during'"
