"""What the orchestrator says to envd itself: ``POST /init`` after every create, restore and claim."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import httpx

from forkyard.errors import ForkyardError, Unavailable
from forkyard.orchestrator.envd_exec import EnvdExec
from forkyard.orchestrator.timing import utcnow
from forkyard.types import ENVD_INIT_REVALIDATE, SANDBOX_USER, SandboxInstance

log = logging.getLogger(__name__)

INIT_ATTEMPTS = 20


class EnvdClient:
    def __init__(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False)

    async def init(
        self,
        instance: SandboxInstance,
        envs: dict[str, str],
        access_token: str | None,
        *,
        current_token: str | None = None,
        revalidate: bool = True,
    ) -> None:
        """``POST /init``: env vars, access token, clock and default user (envd.yaml).
        ``current_token``: the token envd holds when it is not ``access_token`` (a rollback to
        another sandbox's snapshot); the request authenticates with it and sets the new one.
        ``revalidate=False`` (our extension): the sandbox ran on since its previous ``/init``
        (no restore between), so envd keeps its captured logins without checking them."""
        body: dict[str, object] = {
            "envVars": envs,
            "timestamp": utcnow().isoformat().replace("+00:00", "Z"),
            "defaultUser": SANDBOX_USER,
            # No defaultWorkdir: envd has the template's final WORKDIR from its runtime (E2B's
            # default directory of commands), else the user's home.
        }
        if not revalidate:
            body[ENVD_INIT_REVALIDATE] = False
        headers = {}
        if access_token:
            body["accessToken"] = access_token
            headers["X-Access-Token"] = access_token
        if current_token:
            headers["X-Access-Token"] = current_token
        url = instance.envd_url.rstrip("/") + "/init"
        last: Exception | None = None
        for attempt in range(INIT_ATTEMPTS):
            try:
                resp = await self._http.post(url, json=body, headers=headers)
            except httpx.TransportError as exc:  # envd answered /health, so this is transient
                last = exc
                # A first failure can be a kept-alive connection to whatever had this address
                # before (a killed sandbox, this one before its checkpoint), which the new sandbox
                # resets at once: a new connection needs no wait.
                if attempt:
                    await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), 0.5))
                continue
            if resp.status_code >= 300:
                raise Unavailable(f"envd /init answered {resp.status_code}: {resp.text[:300]}")
            return
        # repr: httpx's timeouts have no message, their type says which wait ran out (connect,
        # read, pool); a flake once reported only "unreachable at <url>: " after 20 x 10 s.
        raise Unavailable(f"envd /init unreachable at {url} after {INIT_ATTEMPTS} attempts: {last!r}")

    async def fsfreeze(self, instance: SandboxInstance, access_token: str | None) -> None:
        """``POST /fsfreeze``: the root flushed to disk before a filesystem-only pause kills the
        sandbox (envd.yaml; E2B's filesystem pause needs a responding envd too)."""
        await self._post(instance, "/fsfreeze", access_token)

    async def fsthaw(self, instance: SandboxInstance, access_token: str | None) -> None:
        """``POST /fsthaw``: undo :meth:`fsfreeze` when the pause did not happen."""
        await self._post(instance, "/fsthaw", access_token)

    async def _post(self, instance: SandboxInstance, path: str, access_token: str | None) -> None:
        headers = {"X-Access-Token": access_token} if access_token else {}
        url = instance.envd_url.rstrip("/") + path
        try:
            resp = await self._http.post(url, headers=headers)
        except httpx.TransportError as exc:
            raise Unavailable(f"envd did not answer {path} at {url}: {exc}") from exc
        if resp.status_code >= 300:
            raise Unavailable(f"envd {path} answered {resp.status_code}: {resp.text[:300]}")

    async def close(self) -> None:
        await self._http.aclose()


#: What a sandbox restored ahead of demand runs once (see :func:`initialised`): a command printing
#: an empty line, sent as ``commands.run`` sends one, so that it takes the path the first real one
#: takes (the default user's captured login: the profile does not run again unless no capture
#: stands, when a capture would run it anyway).
WARM_UP_COMMAND = ["/bin/bash", "-l", "-c", "echo"]
#: The longest a warm-up may take (it takes ~35 ms; a profile that hangs must not stall the pool).
WARM_UP_TIMEOUT_S = 10.0


class Kills(Protocol):
    """Who kills a sandbox that is no one's yet (``rowless.RowlessSandboxes``)."""

    async def kill(self, instance: SandboxInstance) -> None: ...


async def initialised(
    client: EnvdClient,
    commands: EnvdExec,
    owner: Kills,
    instance: SandboxInstance,
    envs: dict[str, str],
    access_token: str | None,
) -> SandboxInstance:
    """A sandbox restored ahead of demand (warm pool, standby), after its ``/init`` and one
    command that only prints an empty line. The ``/init`` does what a restore needs from envd
    (new watches, the captured logins checked) before anyone claims it, so the claim's own
    ``/init`` skips it. The command faults in what the first command after a restore touches
    (envd's process-start path, its captured login, the output path, bash's pages): without it
    a claim's first ``echo hi`` was 12 ms slower than its second (49.2 against 37.2 ms p50, 16
    creates), with it 4 ms (41.5 against 37.3; docs/LATENCY.md, session 8). Killed by ``owner``
    if the ``/init`` fails (no one else owns it yet); a warm-up that fails (a root without bash) or
    hangs is only logged."""
    try:
        await client.init(instance, envs, access_token)
    except BaseException:
        with contextlib.suppress(Exception):
            await owner.kill(instance)
        raise
    try:
        async with asyncio.timeout(WARM_UP_TIMEOUT_S):
            await commands.run(instance, WARM_UP_COMMAND, user=None, access_token=access_token)
    except ForkyardError as exc:
        log.info("warming up the commands of %s failed: %s", instance.sandbox_id, exc)
    except TimeoutError:
        # Only without a captured login does bash -l run the profile: one that hangs would hang
        # every command of the sandbox as well. The pool still gets the sandbox.
        log.warning(
            "warming up the commands of %s: no answer in %.0f s", instance.sandbox_id, WARM_UP_TIMEOUT_S
        )
    return instance
