"""The languages the SDKs name, the Jupyter kernel each runs on, and how each sets and restores
environment variables inside a running kernel (the process environment of the kernel itself, so
subprocesses the code starts see them too)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Protocol


class EnvCode(Protocol):
    def __call__(self, envs: dict[str, str]) -> str: ...


@dataclass(frozen=True)
class Language:
    name: str
    #: The kernelspec jupyter_client starts: ours (``kernelspecs/``) or the template's
    #: (``jupyter kernelspec list`` inside it).
    kernel: str
    #: Code that sets ``envs`` and remembers what each variable was (restored by ``restore_env``).
    set_env: EnvCode
    #: Code that restores what the last ``set_env`` changed.
    restore_env: str
    #: The kernel shows a cell's value as display data, not as an execute result (IRkernel's
    #: autoprint): its displays are the cell's results (``Execution.text``).
    displays_are_results: bool = False


def _python_set(envs: dict[str, str]) -> str:
    return (
        "import os as __fy_os\n"
        f"__fy_envs = {json.dumps(envs)}\n"
        "__fy_saved = {k: __fy_os.environ.get(k) for k in __fy_envs}\n"
        "__fy_os.environ.update(__fy_envs)\n"
        "del __fy_envs, __fy_os\n"
    )


_PYTHON_RESTORE = (
    "import os as __fy_os\n"
    "for __fy_k, __fy_v in __fy_saved.items():\n"
    "    if __fy_v is None:\n"
    "        __fy_os.environ.pop(__fy_k, None)\n"
    "    else:\n"
    "        __fy_os.environ[__fy_k] = __fy_v\n"
    "del __fy_saved, __fy_os\n"
    "try:\n    del __fy_k, __fy_v\nexcept NameError:\n    pass\n"
)


def _bash_set(envs: dict[str, str]) -> str:
    lines = ["__fy_saved=()"]
    for key, value in envs.items():
        lines.append(
            f'if [ -n "${{{key}+x}}" ]; then __fy_saved+=("export {key}=$(printf %q "${key}")"); '
            f'else __fy_saved+=("unset {key}"); fi'
        )
        lines.append(f"export {key}={shlex.quote(value)}")
    return "\n".join(lines)


_BASH_RESTORE = 'for __fy_line in "${__fy_saved[@]}"; do eval "$__fy_line"; done; unset __fy_saved __fy_line'


def _js_set(envs: dict[str, str]) -> str:
    payload = json.dumps(envs)
    return (
        f"globalThis.__fySaved = Object.fromEntries(Object.keys({payload}).map(k => [k, process.env[k]]));"
        f"Object.assign(process.env, {payload});"
    )


_JS_RESTORE = (
    "for (const [k, v] of Object.entries(globalThis.__fySaved || {})) "
    "{ if (v === undefined) delete process.env[k]; else process.env[k] = v; } delete globalThis.__fySaved;"
)


def _r_set(envs: dict[str, str]) -> str:
    names = ", ".join(json.dumps(k) for k in envs)
    values = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in envs.items())
    return (
        f".fy_saved <- Sys.getenv(c({names}), unset = NA, names = TRUE)\n"
        f"invisible(do.call(Sys.setenv, list({values})))"
    )


_R_RESTORE = (
    "for (.fy_k in names(.fy_saved)) { if (is.na(.fy_saved[[.fy_k]])) Sys.unsetenv(.fy_k) "
    "else do.call(Sys.setenv, setNames(list(.fy_saved[[.fy_k]]), .fy_k)) }\n"
    "rm(.fy_saved, .fy_k)"
)


def _no_env(envs: dict[str, str]) -> str:
    """The JVM's environment is read-only once started: Java cells see the variables the kernel
    was started with (the sandbox's), not per-execution ones."""
    return ""


LANGUAGES: dict[str, Language] = {
    # ipykernel without its debugger (kernelspecs/forkyard-python/launch.py).
    "python": Language("python", "forkyard-python", _python_set, _PYTHON_RESTORE),
    # tslab behind our launcher (tslab_kernel.js): the last expression is the cell's result.
    "javascript": Language("javascript", "forkyard-jslab", _js_set, _JS_RESTORE),
    "typescript": Language("typescript", "forkyard-tslab", _js_set, _JS_RESTORE),
    "bash": Language("bash", "bash", _bash_set, _BASH_RESTORE),
    "r": Language("r", "ir", _r_set, _R_RESTORE, displays_are_results=True),
    "java": Language("java", "java", _no_env, ""),
}
ALIASES = {"js": "javascript", "ts": "typescript", "py": "python", "python3": "python", "sh": "bash"}
DEFAULT_LANGUAGE = "python"


def resolve(name: str | None) -> Language | None:
    """The language the SDK named (case-insensitive, short names too), None if unknown."""
    key = (name or DEFAULT_LANGUAGE).strip().lower()
    return LANGUAGES.get(ALIASES.get(key, key))
