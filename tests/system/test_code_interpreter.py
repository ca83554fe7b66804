"""E2B's code interpreter unchanged: the published ``e2b-code-interpreter`` (sync and async) against
a real ``forkyard serve`` and the ``code-interpreter-v1`` template (its server:
forkyard/interpreter). One sandbox serves the Python protocol checks; the languages, contexts,
environment variables, timeouts, pause/resume and forks get their own.
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
from collections.abc import Iterator

import pytest
from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.charts import ChartType

from tests.support import SHARED_TEMPLATES, base_template_missing
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("code-interpreter sandboxes are real gVisor sandboxes")

TEMPLATE = "code-interpreter-v1"


def code_interpreter_missing() -> str | None:
    if base_template_missing():
        return base_template_missing()
    if not (SHARED_TEMPLATES / TEMPLATE / ".complete").is_file():
        return f"{TEMPLATE} is not built in {SHARED_TEMPLATES} (run: forkyard template build {TEMPLATE})"
    return None


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    reason = code_interpreter_missing()
    if reason:
        pytest.skip(reason)
    with serve(prefix="forkyard-ci-") as srv, pytest.MonkeyPatch.context() as env:
        for key, value in srv.sdk_env.items():
            env.setenv(key, value)
        yield srv


@pytest.fixture(scope="module")
def sbx(server: ServerProcess) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=600)  # the SDK's default template: code-interpreter-v1
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_last_expression_is_the_main_result_with_an_execution_count(sbx: Sandbox) -> None:
    first = sbx.run_code("1+1")
    assert first.text == "2"
    assert first.error is None
    assert [r.is_main_result for r in first.results] == [True]
    second = sbx.run_code("x = 40\nx + 2")
    assert second.text == "42"
    assert isinstance(first.execution_count, int) and second.execution_count == first.execution_count + 1


def test_stdout_stderr_and_callbacks_stream(sbx: Sandbox) -> None:
    seen: list[tuple[str, str]] = []
    execution = sbx.run_code(
        "import sys\nprint('out line')\nprint('err line', file=sys.stderr)",
        on_stdout=lambda m: seen.append(("out", m.line)),
        on_stderr=lambda m: seen.append(("err", m.line)),
    )
    assert "".join(execution.logs.stdout) == "out line\n"
    assert "".join(execution.logs.stderr) == "err line\n"
    assert ("out", "out line\n") in seen and ("err", "err line\n") in seen
    assert execution.results == []


def test_error_has_name_value_and_traceback(sbx: Sandbox) -> None:
    errors = []
    execution = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()", on_error=errors.append)
    assert execution.error is not None
    assert execution.error.name == "ValueError"
    assert execution.error.value == "bad value"
    assert "raise ValueError" in re.sub(
        r"\x1b\[[0-9;]*m", "", execution.error.traceback
    )  # IPython colours it
    assert errors and errors[0].name == "ValueError"
    assert sbx.run_code("1 + 1").text == "2"  # the kernel goes on


def test_display_calls_and_every_format(sbx: Sandbox) -> None:
    code = (
        "from IPython.display import display, HTML, Markdown, SVG, JSON, Latex, Javascript\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(Markdown('# title'))\n"
        'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>\'))\n'
        "display(JSON({'k': [1, 2]}))\n"
        "display(Latex(r'$x^2$'))\n"
        "display(Javascript('console.log(1)'))\n"
        "display({'application/x-forkyard-test': {'custom': True}, 'text/plain': 'custom'}, raw=True)\n"
        "'main'"
    )
    execution = sbx.run_code(code)
    assert execution.error is None, execution.error
    results = execution.results
    assert [r.is_main_result for r in results] == [False] * 7 + [True]
    assert results[0].html == "<b>bold</b>"
    assert results[1].markdown == "# title"
    assert results[2].svg is not None and results[2].svg.startswith("<svg")
    assert results[3].json == {"k": [1, 2]}
    assert results[4].latex == "$x^2$"
    assert results[5].javascript == "console.log(1)"
    assert results[6].extra == {"application/x-forkyard-test": {"custom": True}}
    assert "application/x-forkyard-test" in results[6].formats()
    assert execution.text == "'main'"


def test_matplotlib_chart_has_png_and_chart_data(sbx: Sandbox) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [3, 1, 2], label='series')\n"
        "plt.title('my chart')\nplt.xlabel('x')\nplt.ylabel('y')\nplt.show()"
    )
    execution = sbx.run_code(code)
    assert execution.error is None, execution.error
    [figure] = execution.results
    assert base64.b64decode(figure.png).startswith(b"\x89PNG")
    assert figure.chart is not None
    assert figure.chart.type == ChartType.LINE
    assert figure.chart.title == "my chart"
    assert [p for p in figure.chart.elements[0].points] == [(1.0, 3.0), (2.0, 1.0), (3.0, 2.0)]


def test_dataframe_has_data_and_html(sbx: Sandbox) -> None:
    execution = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert execution.error is None, execution.error
    [frame] = execution.results
    assert frame.data == {"columns": ["a", "b"], "index": [0, 1], "data": [[1, "x"], [2, "y"]]}
    assert frame.html is not None and "<table" in frame.html
    assert "data" in frame.formats()


def test_shell_escapes_magics_and_the_data_science_stack(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "!echo from-shell\n%cd /tmp\nimport numpy, scipy, sklearn, seaborn, plotly, requests\n"
        "import getpass, os\n(getpass.getuser(), os.getcwd(), numpy.arange(3).sum())"
    )
    assert execution.error is None, execution.error
    assert "from-shell" in "".join(execution.logs.stdout)
    assert execution.text == "('user', '/tmp', np.int64(3))"
    sbx.run_code("%cd /home/user")


def test_env_vars_per_execution_override_the_sandbox_s_and_are_restored(server: ServerProcess) -> None:
    sandbox = Sandbox.create(envs={"LEVEL": "sandbox", "ONLY_SANDBOX": "s"}, timeout=300)
    try:
        read = (
            "import os, subprocess\n(os.environ.get('LEVEL'), "
            "subprocess.run(['sh', '-c', 'echo $LEVEL'], capture_output=True, text=True).stdout.strip())"
        )
        assert sandbox.run_code(read).text == "('sandbox', 'sandbox')"
        assert sandbox.run_code(read, envs={"LEVEL": "cell"}).text == "('cell', 'cell')"
        assert sandbox.run_code(read).text == "('sandbox', 'sandbox')"
        assert sandbox.run_code("os.environ.get('NEW_ONE')", envs={"NEW_ONE": "1"}).text == "'1'"
        assert sandbox.run_code("os.environ.get('NEW_ONE'), os.environ['ONLY_SANDBOX']").text == "(None, 's')"
        bash = sandbox.run_code("echo $LEVEL", language="bash", envs={"LEVEL": "bash-cell"})
        assert "".join(bash.logs.stdout).strip() == "bash-cell"
        assert "".join(sandbox.run_code("echo $LEVEL", language="bash").logs.stdout).strip() == "sandbox"
    finally:
        sandbox.kill()


def test_contexts_are_independent_and_can_be_listed_restarted_and_removed(sbx: Sandbox) -> None:
    sbx.run_code("shared_name = 'default'")
    context = sbx.create_code_context(cwd="/tmp", language="python")
    assert context.language == "python" and context.cwd == "/tmp"
    assert sbx.run_code("import os; os.getcwd()", context=context).text == "'/tmp'"
    probe = sbx.run_code("shared_name", context=context)
    assert probe.error is not None and probe.error.name == "NameError"
    sbx.run_code("mine = 7", context=context)
    assert sbx.run_code("mine", context=context).text == "7"
    assert context.id in {c.id for c in sbx.list_code_contexts()}
    sbx.restart_code_context(context)
    assert sbx.run_code("mine", context=context).error.name == "NameError"
    assert sbx.run_code("shared_name").text == "'default'"
    sbx.remove_code_context(context)
    assert context.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=context)


def test_bad_input_is_a_clear_error(sbx: Sandbox) -> None:
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="unsupported language"):
        sbx.run_code("1", language="cobol")
    with pytest.raises(SandboxException, match="not a directory"):
        sbx.create_code_context(cwd="/no/such/dir")


def test_a_timeout_interrupts_the_cell_and_keeps_the_kernel_and_its_state(sbx: Sandbox) -> None:
    sbx.run_code("kept = 'before'")
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nkept = 'during'\ntime.sleep(60)\nkept = 'after'", timeout=3)
    assert time.monotonic() - started < 20
    started = time.monotonic()
    assert sbx.run_code("kept").text == "'during'"  # interrupted before the last line
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    ("language", "code", "expected"),
    [
        ("bash", "echo $((20 + 22))", "42"),
        ("r", "x <- 40\nprint(x + 2)", "[1] 42"),
        ("javascript", "const v = await Promise.resolve(40); console.log(v + 2)", "42"),
        ("typescript", "const n: number = 40;\nconsole.log(n + 2)", "42"),
        ("java", "System.out.println(40 + 2);", "42"),
    ],
)
def test_each_language_runs_and_keeps_state(sbx: Sandbox, language: str, code: str, expected: str) -> None:
    execution = sbx.run_code(code, language=language, timeout=180)
    assert execution.error is None, execution.error
    assert expected in "".join(execution.logs.stdout) or execution.text == expected, execution


def test_javascript_results_and_esm_import(sbx: Sandbox) -> None:
    execution = sbx.run_code("import { join } from 'node:path';\nconst p = join('a', 'b');\np", language="js")
    assert execution.error is None, execution.error
    assert execution.text == "a/b" and execution.logs.stdout == []  # E2B's: the value, not a print
    failed = sbx.run_code("throw new Error('js failure')", language="javascript")
    assert failed.error is not None and "js failure" in failed.error.value
    after = sbx.run_code("p", language="js")  # at once after a failure (tslab aborted for 200 ms)
    assert after.error is None and after.text == "a/b", after


def test_js_and_ts_last_expression_is_the_main_result_with_a_count(sbx: Sandbox) -> None:
    """As E2B's ``run_code("1+1", language="js")``: ``results[0]`` is the main result, ``text`` "2"."""
    one = sbx.run_code("1+1", language="js")
    assert [(r.is_main_result, r.text) for r in one.results] == [(True, "2")] and one.logs.stdout == []
    two = sbx.run_code("1+2", language="js")
    assert isinstance(one.execution_count, int) and two.execution_count == one.execution_count + 1
    subtract = "function sub(x: number, y: number): number {\n  return x - y\n}\nsub(1, 2)"
    typed = sbx.run_code(subtract, language="ts")
    assert typed.text == "-1", typed
    awaited = sbx.run_code("async function hello() { return 'Hello' }\nawait hello()", language="ts")
    assert awaited.text == "Hello", awaited  # strings as console.log shows them (E2B's too)
    shown = sbx.run_code(
        "({ [Symbol.for('Jupyter.display')]() { return {'text/plain': 'hi', 'text/html': '<b>hi</b>'} } })",
        language="js",
    )
    assert shown.results[0].html == "<b>hi</b>" and shown.text == "hi", shown
    assert sbx.run_code("const nothing = 1", language="js").results == []


def test_r_and_bash_state_persists(sbx: Sandbox) -> None:
    sbx.run_code("kept_r <- 5", language="r")
    assert sbx.run_code("kept_r * 2", language="r").text == "[1] 10"
    sbx.run_code("KEPT=bash-state", language="bash")
    assert "".join(sbx.run_code("echo $KEPT", language="bash").logs.stdout).strip() == "bash-state"


def test_state_survives_pause_resume_and_connect(server: ServerProcess) -> None:
    sandbox = Sandbox.create(timeout=300)
    try:
        sandbox.run_code("survivor = [1, 2, 3]")
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.run_code("survivor").text == "[1, 2, 3]"
        assert sandbox.pause() is True
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=300)
        assert resumed.run_code("survivor + [4]").text == "[1, 2, 3, 4]"
    finally:
        sandbox.kill()


def test_fork_children_have_the_parent_s_variables_and_diverge(server: ServerProcess) -> None:
    parent = Sandbox.create(timeout=300)
    children: list[Sandbox] = []
    try:
        parent.run_code("import random\ntrail = ['parent']")
        results = parent.fork(count=3, timeout=300)
        children = [Sandbox.connect(c.sandbox_id) for c in results if not isinstance(c, Exception)]
        assert len(children) == 3, results
        for i, child in enumerate(children):
            assert child.run_code("trail").text == "['parent']"
            child.run_code(f"trail.append('child-{i}')")
        for i, child in enumerate(children):
            assert child.run_code("trail").text == f"['parent', 'child-{i}']"
        assert parent.run_code("trail").text == "['parent']"
    finally:
        for child in children:
            child.kill()
        parent.kill()


def test_a_killed_sandbox_gives_the_sdk_s_clean_error(server: ServerProcess) -> None:
    sandbox = Sandbox.create(timeout=300)
    sandbox.kill()
    with pytest.raises((NotFoundException, TimeoutException)):
        sandbox.run_code("1")


def test_async_sdk(server: ServerProcess) -> None:
    async def scenario() -> None:
        sandbox = await AsyncSandbox.create(timeout=300)
        try:
            execution = await sandbox.run_code("1+1")
            assert execution.text == "2"
            outs: list[str] = []

            async def on_stdout(message) -> None:  # type: ignore[no-untyped-def]
                outs.append(message.line)

            await sandbox.run_code("print('async out')", on_stdout=on_stdout)
            assert outs == ["async out\n"]
            context = await sandbox.create_code_context(language="bash")
            assert context.language == "bash"
            bash = await sandbox.run_code("echo hi-$((1+1))", context=context)
            assert "".join(bash.logs.stdout).strip() == "hi-2"
            assert context.id in {c.id for c in await sandbox.list_code_contexts()}
            await sandbox.remove_code_context(context.id)
            with pytest.raises(TimeoutException):
                await sandbox.run_code("import time; time.sleep(60)", timeout=2)
            assert (await sandbox.run_code("2+3")).text == "5"
        finally:
            await sandbox.kill()

    asyncio.run(scenario())
