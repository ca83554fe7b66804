"""Agent frameworks that run model-written code through E2B's code interpreter, unchanged, against
``code-interpreter-v1`` (no LLM: the code an agent would send is sent as it would be).

smolagents' ``E2BExecutor``: ``!pip install`` of a wheel (made here, uploaded into the sandbox),
the package imported and printed in the next cell, variables sent, and ``final_answer`` ending the
run as its executor detects it (an error of its own name through the protocol).

The OpenAI Agents SDK's E2B sandbox (``openai-agents[e2b]``, in its own venv: its extra pins older
E2B SDKs and websockets<17): tests/system/openai_agents_e2b.py, see there."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import secrets
import subprocess
import zipfile
from collections.abc import Iterator

import pytest

from tests.support import REPO, free_port
from tests.support.server import ServerProcess, serve
from tests.system.test_code_interpreter import code_interpreter_missing

pytestmark = pytest.mark.requires_root("code-interpreter sandboxes are real gVisor sandboxes")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    reason = code_interpreter_missing()
    if reason:
        pytest.skip(reason)
    # The Agents SDK's e2b (2.31.0) accepts only keys shaped like E2B's: "e2b_" and hex.
    api_key = "e2b_" + secrets.token_hex(20)
    # Its e2b-code-interpreter (2.8.1) reaches port 49999 only at https://49999-<id>.<domain>, as on
    # E2B's cloud: the node's TLS listener for sandbox names (*.forkyard.localhost resolve to loopback).
    tls = {"FORKYARD_TLS_PORT": str(free_port())}
    with (
        serve(prefix="forkyard-cifw-", api_key=api_key, extra_env=tls) as srv,
        pytest.MonkeyPatch.context() as env,
    ):
        for key, value in srv.sdk_env.items():
            env.setenv(key, value)
        yield srv


def tiny_wheel(name: str, version: str, module_source: str) -> tuple[str, bytes]:
    """A pure-Python wheel (PEP 427) with one module, made in memory."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module_source.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: forkyard-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def test_smolagents_e2b_executor(server: ServerProcess) -> None:
    from smolagents.default_tools import FinalAnswerTool
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import E2BExecutor

    executor = E2BExecutor(additional_imports=[], logger=AgentLogger(level=LogLevel.ERROR), timeout=300)
    try:
        wheel_name, wheel = tiny_wheel("fywheel", "0.1", "def hello():\n    return 'hello from a wheel'\n")
        executor.sandbox.files.write(f"/home/user/{wheel_name}", wheel)
        installed = executor(f"!pip install --no-index /home/user/{wheel_name}")
        assert "Successfully installed fywheel-0.1" in installed.logs
        printed = executor("import fywheel\nprint(fywheel.hello())")
        assert printed.logs.strip() == "hello from a wheel" and not printed.is_final_answer
        executor.send_variables({"answer_base": 40})
        executor.send_tools({"final_answer": FinalAnswerTool()})
        final = executor("final_answer(answer_base + 2)")
        assert final.is_final_answer and final.output == 42
    finally:
        executor.cleanup()
    logging.getLogger(__name__).info("smolagents ran on %s", server.url)


AGENTS_PYTHON = REPO / ".venv-agents" / "bin" / "python"


def test_openai_agents_sdk_e2b_code_interpreter_sandbox_runs_a_cell(server: ServerProcess) -> None:
    """``E2BSandboxClient`` with ``sandbox_type="e2b_code_interpreter"``: the sandbox it creates is
    a ``code-interpreter-v1`` one, a cell runs in it, and the agent's ``exec_command`` tool and the
    session's file read see what the cell wrote; closing the session kills the sandbox."""
    if not AGENTS_PYTHON.exists():
        pytest.fail(f"{AGENTS_PYTHON} is missing (scripts/bootstrap.sh --test installs the Agents SDK)")
    proc = subprocess.run(
        [str(AGENTS_PYTHON), str(REPO / "tests" / "system" / "openai_agents_e2b.py")],
        capture_output=True,
        text=True,
        timeout=300,
        # The node's CA (and the system's), as a user's program trusts it for sandbox names.
        env={**os.environ, **server.sdk_env, "SSL_CERT_FILE": str(server.data_dir / "tls" / "ca-bundle.pem")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["template"] == "code-interpreter-v1"
    assert out["cell"] == {"text": "42", "error": None}
    assert out["cell_cwd"] == "'/home/user'"
    assert "Process exited with code 0" in out["tool"] and out["tool"].rstrip().endswith("42\n42"), out
    assert out["files_read"] == "42"
    assert out["running_after_close"] is False
