"""The code interpreter's server (forkyard/interpreter) on the host, driving a real IPython kernel:
the NDJSON lines the SDKs parse, environment variables, contexts, interrupts, bad input. The same
server inside the template is tested through the published SDKs in
tests/system/test_code_interpreter.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from forkyard.interpreter import outputs
from forkyard.interpreter.app import create_app
from forkyard.interpreter.languages import LANGUAGES, resolve
from tests.support import free_port

pytest.importorskip("ipykernel", reason="the test extra pins ipykernel (pip install -e '.[test]')")


# The tests here run on a loop of their own (the default test loop scope): so must the kernel they
# drive. Under the default *fixture* loop scope (the session's loop, pyproject.toml) the kernel's
# ZeroMQ sockets were first polled on the session loop, then on the test's; pyzmq moves a socket's
# reader to the new loop without removing it from the old one, so each closed socket left a reader
# in the session loop's selector for an fd number that epoll had dropped. The next socket given
# that number there is never watched: a loopback sandbox's listener never accepted, and every
# envd /init to it timed out (test_lifecycle's create, 20 x 10 s).
@pytest_asyncio.fixture(loop_scope="function")
async def client(tmp_path: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(str(tmp_path))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://interpreter") as c:
            yield c


async def run(client: httpx.AsyncClient, code: str, **extra: Any) -> list[dict[str, Any]]:
    response = await client.post("/execute", json={"code": code, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def kinds(lines: list[dict[str, Any]]) -> list[str]:
    return [line["type"] for line in lines if line["type"] != "keepalive"]


async def test_result_stdout_and_the_end_marker(client: httpx.AsyncClient) -> None:
    lines = await run(client, "print('hello')\n1 + 1")
    assert kinds(lines) == ["number_of_executions", "stdout", "result", "end_of_execution"]
    assert lines[1]["text"] == "hello\n" and isinstance(lines[1]["timestamp"], int)
    assert lines[2] == {"type": "result", "is_main_result": True, "text": "2"}
    again = await run(client, "2")
    assert again[0]["execution_count"] == lines[0]["execution_count"] + 1


async def test_error_line(client: httpx.AsyncClient) -> None:
    lines = await run(client, "raise RuntimeError('boom')")
    [error] = [line for line in lines if line["type"] == "error"]
    assert error["name"] == "RuntimeError" and error["value"] == "boom"
    assert "RuntimeError" in error["traceback"]


async def test_env_vars_apply_to_one_execution_and_are_restored(client: httpx.AsyncClient) -> None:
    os.environ.pop("FY_UNIT_VAR", None)
    read = "import os; repr(os.environ.get('FY_UNIT_VAR'))"
    assert (await run(client, read, env_vars={"FY_UNIT_VAR": "x"}))[1]["text"] == "\"'x'\""
    assert (await run(client, read))[1]["text"] == "'None'"
    names = await run(client, "sorted(k for k in dir() if k.startswith('__fy'))")
    assert names[1]["text"] == "[]"


async def test_contexts_are_independent_and_unknown_ones_are_404(
    client: httpx.AsyncClient, tmp_path: Any
) -> None:
    await run(client, "in_default = 1")
    created = (await client.post("/contexts", json={"language": "python", "cwd": "/"})).json()
    assert created["language"] == "python" and created["cwd"] == "/"
    lines = await run(client, "import os; os.getcwd(), 'in_default' in dir()", context_id=created["id"])
    assert lines[1]["text"] == "('/', False)"
    listed = (await client.get("/contexts")).json()
    assert created in listed and len(listed) == 2
    assert (await client.post(f"/contexts/{created['id']}/restart")).status_code == 204
    assert (await client.delete(f"/contexts/{created['id']}")).status_code == 204
    missing = await client.post("/execute", json={"code": "1", "context_id": created["id"]})
    assert missing.status_code == 404 and created["id"] in missing.json()["message"]
    assert (await client.delete("/contexts/nope")).status_code == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"code": 1}, "code must be a string"),
        ({"code": "1", "language": "cobol"}, "unsupported language"),
        ({"code": "1", "language": "python", "context_id": "x"}, "not both"),
        ({"code": "1", "env_vars": {"A": 1}}, "env_vars"),
        ({"code": "1", "env_vars": {"A-B": "1"}}, "invalid environment variable name"),
    ],
)
async def test_bad_input_is_400_in_e2b_s_shape(client: httpx.AsyncClient, body: Any, message: str) -> None:
    response = await client.post("/execute", json=body)
    assert response.status_code == 400
    assert response.json()["code"] == 400 and message in response.json()["message"]


async def test_bad_context_requests(client: httpx.AsyncClient) -> None:
    assert (await client.post("/contexts", content=b"[1]")).status_code == 400
    assert (await client.post("/contexts", json={"cwd": "relative"})).status_code == 400
    assert (await client.post("/contexts", json={"cwd": "/no/such/dir"})).status_code == 400


def test_an_abandoned_cell_is_interrupted_and_the_kernel_stays_usable(tmp_path: Any) -> None:
    """Over a real socket (the in-process transport buffers whole responses): the client's
    timeout closes the connection, the server interrupts the cell, the kernel keeps its state."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "forkyard.interpreter", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "HOME": str(tmp_path)},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.2)
        httpx.post(f"{url}/execute", json={"code": "kept = 'before'"}, timeout=30)
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/execute", json={"code": "import time\nkept='during'\ntime.sleep(60)"}, timeout=2
            )
        lines = httpx.post(f"{url}/execute", json={"code": "kept"}, timeout=30).text.splitlines()
        assert json.loads(lines[1])["text"] == "'during'"
        assert time.monotonic() - started < 20
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_languages_resolve_their_short_names() -> None:
    assert resolve(None) is LANGUAGES["python"]
    assert resolve("JS") is LANGUAGES["javascript"] and resolve("ts") is LANGUAGES["typescript"]
    assert resolve("cobol") is None


def test_result_line_maps_mime_types_and_keeps_unknown_ones_in_extra() -> None:
    line = outputs.result_line(
        {
            "text/plain": "t",
            "image/png": "b64",
            outputs.CHART_MIME: {"type": "line"},
            outputs.DATA_MIME: {"columns": []},
            "application/x-custom": {"k": 1},
        },
        is_main_result=False,
    )
    assert line == {
        "type": "result",
        "is_main_result": False,
        "text": "t",
        "png": "b64",
        "chart": {"type": "line"},
        "data": {"columns": []},
        "extra": {"application/x-custom": {"k": 1}},
    }


def test_an_error_only_in_the_reply_takes_its_name_and_value_from_stderr() -> None:
    stderr = "evalmachine.<anonymous>:2\nthrow new Error('js failure');\n^\n\nError: js failure\n    at x\n"
    line = outputs.reply_error_line({"status": "error"}, stderr)
    assert line == {"type": "error", "name": "Error", "value": "js failure", "traceback": stderr}
    named = outputs.reply_error_line({"status": "error", "ename": "E", "evalue": "v", "traceback": ["t"]}, "")
    assert named == {"type": "error", "name": "E", "value": "v", "traceback": "t"}


def test_the_envs_file_is_where_the_runtime_has_envd_keep_it() -> None:
    from forkyard.interpreter import ENVS_FILE
    from forkyard.types import SANDBOX_ENVS_FILE

    assert ENVS_FILE == SANDBOX_ENVS_FILE  # the interpreter imports nothing of forkyard: two constants


async def test_sandbox_envs_follow_envd_s_file_and_a_kernel_gets_the_new_values(tmp_path: Any) -> None:
    """envd's ``/init`` rewrites the file (a create after a restore, a fork); the server reads it
    again only then and the next cell sees the new values."""
    from forkyard.envd.state import EnvdState
    from forkyard.interpreter.contexts import SandboxEnvs

    envs_file = tmp_path / "run" / "envs.json"
    envd = EnvdState(envs_file=str(envs_file))
    envd.publish_env_vars()
    assert json.loads(envs_file.read_text()) == {} and oct(envs_file.stat().st_mode & 0o777) == "0o644"
    cached = SandboxEnvs(str(envs_file))
    assert await cached.current() == {}
    envd.set_env_vars({"FY_LEVEL": "create"})
    assert await cached.current() == {"FY_LEVEL": "create"}
    before = envs_file.stat().st_ino
    envd.set_env_vars({"FY_LEVEL": "create"})  # unchanged: not rewritten
    assert envs_file.stat().st_ino == before
    app = create_app(str(tmp_path), envs_file=str(envs_file))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://interpreter") as client:
            code = "import os; os.environ.get('FY_LEVEL')"
            assert (await run(client, code))[1]["text"] == "'create'"
            envd.set_env_vars({"FY_LEVEL": "fork"})
            assert (await run(client, code))[1]["text"] == "'fork'"


async def test_output_written_before_a_flush_still_comes_before_the_result(client: httpx.AsyncClient) -> None:
    """Flushes of empty streams return at once (ipython_startup.py); written ones still go out."""
    code = "import sys\nsys.stdout.write('a')\nsys.stdout.flush()\nsys.stderr.write('b')\n7"
    lines = await run(client, code)
    assert kinds(lines) == ["number_of_executions", "stdout", "stderr", "result", "end_of_execution"]
    assert [lines[1]["text"], lines[2]["text"], lines[3]["text"]] == ["a", "b", "7"]
    patched = await run(client, "import sys\nsys.stdout.flush.__qualname__, sys.stderr.flush.__qualname__")
    assert patched[1]["text"].count("__forkyard_flush_only_when_written") == 2, patched


async def test_the_python_kernel_runs_without_ipykernel_s_debugger(client: httpx.AsyncClient) -> None:
    """~100 debugpy/pydevd modules per idle kernel that E2B's SDKs never use; the user can still
    import debugpy, and the kernel's import path does not hold the launcher's directory."""
    code = (
        "import sys\n"
        "loaded = sorted({m for m in sys.modules if 'pydevd' in m or m.startswith('debugpy')})\n"
        "import debugpy\n"
        "(loaded, debugpy.__name__, any('kernelspecs' in p for p in sys.path))"
    )
    lines = await run(client, code)
    assert lines[1] == {"type": "result", "is_main_result": True, "text": "([], 'debugpy', False)"}, lines
