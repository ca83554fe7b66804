"""One Jupyter kernel per context, driven with ``jupyter_client`` (ZeroMQ on loopback).

A kernel runs one cell at a time: :meth:`Kernel.execute` holds the kernel's lock until the cell's
reply and its last output arrived. A cell whose client went away (the SDK's ``timeout``, a dropped
connection) is interrupted and drained in the background (:meth:`Kernel.abandon`), so the next
request finds the kernel idle with its state intact. A kernel that died is started again on its
next use (its state is gone, as in Jupyter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from .languages import Language
from .outputs import reply_error_line, translate

logger = logging.getLogger("forkyard.interpreter")

#: How long a kernel gets to answer its first kernel_info request.
START_TIMEOUT_S = 120.0
#: How long an interrupted cell gets to finish before the kernel is restarted instead.
INTERRUPT_GRACE_S = 10.0
#: Silence after which an execution stream sends a keepalive line (proxies drop idle streams).
KEEPALIVE_S = 5.0
#: The execute reply comes with or just after the kernel's idle status.
REPLY_WAIT_S = 2.0
STARTUP_FILE = Path(__file__).with_name("ipython_startup.py")
#: Kernelspecs of ours (tslab's behind tslab_kernel.js), found before the installed ones.
KERNELSPECS_DIR = Path(__file__).with_name("kernelspecs")


def kernel_specs() -> KernelSpecManager:
    specs = KernelSpecManager()
    specs.kernel_dirs = [str(KERNELSPECS_DIR), *specs.kernel_dirs]
    return specs


class KernelDied(RuntimeError):
    pass


class Kernel:
    def __init__(self, language: Language, cwd: str, env: dict[str, str]) -> None:
        self.language = language
        self.cwd = cwd
        self.env = env
        self.manager = self._manager()
        self.client: Any = None
        self.lock = asyncio.Lock()
        #: The sandbox-level variables this kernel holds now (see :meth:`apply_sandbox_envs`).
        self.applied_envs: dict[str, str] = {}

    def _manager(self) -> AsyncKernelManager:
        return AsyncKernelManager(kernel_name=self.language.kernel, kernel_spec_manager=kernel_specs())

    async def start(self) -> None:
        extra: list[str] = []
        if self.language.name == "python":
            extra = [f"--IPKernelApp.exec_files={[str(STARTUP_FILE)]!r}"]
        await self.manager.start_kernel(cwd=self.cwd, env=self.env, extra_arguments=extra)
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            await self.client.wait_for_ready(timeout=START_TIMEOUT_S)
        except RuntimeError as exc:
            raise KernelDied(f"the {self.language.name} kernel did not start: {exc}") from exc
        self.applied_envs = {}

    async def shutdown(self) -> None:
        if self.client is not None:
            self.client.stop_channels()
        with contextlib.suppress(Exception):
            await self.manager.shutdown_kernel(now=True)

    async def restart(self) -> None:
        """A fresh kernel (state gone), same language and working directory."""
        await self.shutdown()
        self.manager = self._manager()
        await self.start()

    async def ensure_alive(self) -> None:
        if not await self.manager.is_alive():
            logger.warning("the %s kernel died: starting it again", self.language.name)
            await self.restart()

    async def run_silently(self, code: str) -> None:
        """Code of ours (environment variables): no history, no execution count, outputs dropped."""
        if not code:
            return
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False)
        await self._drain(msg_id, INTERRUPT_GRACE_S)

    async def apply_sandbox_envs(self, envs: dict[str, str]) -> None:
        """The sandbox's variables (``Sandbox.create(envs=...)``, :class:`~.contexts.SandboxEnvs`:
        a restored or forked kernel gets the new sandbox's) become the kernel's own."""
        changed = {k: v for k, v in envs.items() if self.applied_envs.get(k) != v}
        if changed:
            await self.run_silently(self.language.set_env(changed))
            # set_env remembers values to restore: a sandbox-level value is never restored.
            await self.run_silently(_forget_saved(self.language))
            self.applied_envs.update(changed)

    async def run(
        self, code: str, sandbox_envs: dict[str, str], envs: dict[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """One request: waits for the kernel, applies the sandbox's variables and the request's
        (which override them for this cell only), streams the cell's lines, restores. A caller
        that stops reading hands the kernel to :meth:`_recover`, which releases it once idle."""
        await self.lock.acquire()
        msg_id = None
        cell_done = False
        try:
            await self.ensure_alive()
            await self.apply_sandbox_envs(sandbox_envs)
            if envs:
                await self.run_silently(self.language.set_env(envs))
            msg_id = self.client.execute(code, silent=False, store_history=True, allow_stdin=False)
            errored, stderr = False, []
            async for msg in self._messages(msg_id):
                line = _line(msg, self.language)
                if line is not None:
                    errored = errored or line["type"] == "error"
                    if line["type"] == "stderr":
                        stderr.append(line["text"])
                    yield line
            cell_done = True
            reply = await self._reply(msg_id)
            if not errored and reply.get("status") == "error":
                yield reply_error_line(reply, "".join(stderr))
            if envs:
                await self.run_silently(self.language.restore_env)
        except BaseException:
            if msg_id is not None:
                # A cell still running is interrupted; one that ended only needs its variables back.
                recover = self._recover(None if cell_done else msg_id, restore=bool(envs))
                asyncio.get_running_loop().create_task(recover)
                raise
            self.lock.release()
            raise
        self.lock.release()

    async def _messages(self, msg_id: str) -> AsyncIterator[dict[str, Any]]:
        """iopub messages of ``msg_id`` until the kernel is idle again; a keepalive pseudo-message
        after each quiet ``KEEPALIVE_S``. Messages of earlier (silent) requests are skipped."""
        while True:
            try:
                msg = await self.client.get_iopub_msg(timeout=KEEPALIVE_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # queue.Empty: nothing within the interval
                if not await self.manager.is_alive():
                    raise KernelDied(f"the {self.language.name} kernel died during the execution") from None
                yield {"header": {"msg_type": "keepalive"}}
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["header"]["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return
            yield msg

    async def _reply(self, msg_id: str) -> dict[str, Any]:
        """The content of the execute reply to ``msg_id`` (replies to our silent requests before
        it are skipped); {} when none comes in time (the outputs were complete anyway)."""
        try:
            async with asyncio.timeout(REPLY_WAIT_S):
                while True:
                    msg = await self.client.get_shell_msg()
                    if msg.get("parent_header", {}).get("msg_id") == msg_id:
                        content: dict[str, Any] = msg.get("content", {})
                        return content
        except TimeoutError:
            return {}

    async def _drain(self, msg_id: str, limit_s: float) -> None:
        async with asyncio.timeout(limit_s):
            async for _ in self._messages(msg_id):
                pass

    async def _recover(self, msg_id: str | None, *, restore: bool) -> None:
        try:
            if msg_id is not None:
                await self.manager.interrupt_kernel()
                await self._drain(msg_id, INTERRUPT_GRACE_S)
            if restore:
                await self.run_silently(self.language.restore_env)
        except Exception:
            logger.exception("an interrupted %s cell did not stop: restarting the kernel", self.language.name)
            with contextlib.suppress(Exception):
                await self.restart()
        finally:
            self.lock.release()


def _line(msg: dict[str, Any], language: Language) -> dict[str, Any] | None:
    kind = msg["header"]["msg_type"]
    if kind == "keepalive":
        return {"type": "keepalive"}
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": msg["content"]["execution_count"]}
    return translate(msg, displays_are_results=language.displays_are_results)


def _forget_saved(language: Language) -> str:
    """Code dropping what ``set_env`` remembered, without restoring it."""
    forget = {
        "python": "del __fy_saved",
        "bash": "unset __fy_saved",
        "javascript": "delete globalThis.__fySaved;",
        "typescript": "delete globalThis.__fySaved;",
        "r": "rm(.fy_saved)",
    }
    return forget.get(language.name, "")


def kernel_env(home: str) -> dict[str, str]:
    """What a kernel starts with: the server's environment without the server's own settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKYARD_INTERPRETER_")}
    env.pop("PYTHONPATH", None)  # ours, to import this package: the user's code must not see it
    env.setdefault("HOME", home)
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    return env
