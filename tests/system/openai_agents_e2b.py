"""The OpenAI Agents SDK's E2B sandbox on ``code-interpreter-v1``, as an agent uses it, without an LLM.

Run by tests/system/test_code_interpreter_frameworks.py with the Agents SDK's own venv
(``.venv-agents``: ``openai-agents[e2b]``, which pins its E2B SDKs) and the server's E2B_* variables;
prints one JSON object. The SDK (0.24.0) reaches E2B through ``E2BSandboxClient``: with
``sandbox_type="e2b_code_interpreter"`` it creates an ``e2b_code_interpreter.AsyncSandbox`` (the
code interpreter's default template) and its agents act through capabilities (the shell's
``exec_command`` tool, the workspace's files). It has no code path that runs a cell itself
(``run_code`` appears nowhere in it): a cell runs in the sandbox it made, found by the session's
``sandbox_id``, with the code-interpreter SDK its extra installs.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.sandbox import Manifest
from agents.sandbox.capabilities import Shell
from agents.tool_context import ToolContext
from e2b_code_interpreter import AsyncSandbox


async def call_tool(tool: Any, arguments: dict[str, Any]) -> str:
    """A tool call as the agent runner makes it for a model's function call."""
    raw = json.dumps(arguments)
    context = ToolContext(context=None, tool_name=tool.name, tool_call_id="call_1", tool_arguments=raw)
    return str(await tool.on_invoke_tool(context, raw))


async def main() -> dict[str, Any]:
    client = E2BSandboxClient()
    options = E2BSandboxClientOptions(sandbox_type="e2b_code_interpreter", timeout=300)
    # The agent's workspace is the code interpreter's working directory: cells and tools share files.
    session = await client.create(options=options, manifest=Manifest(root="/home/user"))
    out: dict[str, Any] = {}
    async with session:
        sandbox_id = session.state.sandbox_id
        sandbox = await AsyncSandbox.connect(sandbox_id)
        out["template"] = (await sandbox.get_info()).template_id
        code = "import os\nanswer = 40 + 2\nopen('cell.txt', 'w').write(str(answer))\nanswer"
        cell = await sandbox.run_code(code)
        out["cell"] = {"text": cell.text, "error": str(cell.error) if cell.error else None}
        out["cell_cwd"] = (await sandbox.run_code("os.getcwd()")).text
        shell = Shell()
        shell.bind(session)
        [exec_command] = [t for t in shell.tools() if t.name == "exec_command"]
        command = "cat cell.txt; echo; python3 -c 'print(6 * 7)'"
        out["tool"] = await call_tool(exec_command, {"cmd": command})
        out["files_read"] = (await session.read("cell.txt")).read().decode()
    out["running_after_close"] = await sandbox.is_running()
    if out["running_after_close"]:
        await sandbox.kill()
    return out


if __name__ == "__main__":
    json.dump(asyncio.run(main()), sys.stdout)
