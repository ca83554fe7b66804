"""The operators' commands' HTTP client: the E2B API at the URL and key the SDKs use.

The URL and key come from the official SDK's own ``ConnectionConfig`` (``E2B_API_URL``, else
``https://api.$E2B_DOMAIN``; ``E2B_API_KEY``; ``E2B_SANDBOX_URL`` for envd), so the CLI reaches the
same place a trainer's SDK does: one node or a gateway in front of many. Errors leave as
:class:`CliError` carrying E2B's ``message``; :func:`run` turns them into one line on stderr and
exit code 1 (typer's usage errors keep their 2).
"""

from __future__ import annotations

import sys
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import httpx
import typer

if TYPE_CHECKING:  # the SDK is imported on use: `forkyard serve` does not pay for it
    from e2b import ConnectionConfig

T = TypeVar("T")
REQUEST_TIMEOUT_S = 60.0


class CliError(Exception):
    """A failure to report in one line: E2B's message, or why the API could not be reached."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def connection() -> ConnectionConfig:
    """The SDK's view of the environment: the same variables, the same defaults."""
    from e2b import ConnectionConfig

    return ConnectionConfig()


def fail(message: str) -> NoReturn:
    raise CliError(message)


def _message(resp: httpx.Response) -> str:
    """E2B's ``{"code", "message"}`` body, or the status line when the body is something else
    (a gateway's HTML error page)."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return f"{resp.status_code} {resp.reason_phrase}".strip()


class Api:
    """Blocking calls to the control plane; every non-2xx answer raises :class:`CliError`."""

    def __init__(self, config: ConnectionConfig | None = None) -> None:
        self.config = config or connection()
        if not self.config.api_key:
            fail("no API key: set E2B_API_KEY (the server prints it; /var/lib/forkyard/api-key)")
        self.base_url = self.config.api_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"X-API-Key": self.config.api_key, "User-Agent": "forkyard-cli"},
            timeout=REQUEST_TIMEOUT_S,
        )

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach the API at {self.base_url}: {exc}") from exc
        if resp.is_error:
            raise CliError(_message(resp), resp.status_code)
        return resp

    def get_json(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs).json()

    def list_sandboxes(self, states: list[str], metadata: dict[str, str]) -> list[dict[str, Any]]:
        """Every page of ``GET /v2/sandboxes`` (the SDK's query encoding for metadata)."""
        params: list[tuple[str, str]] = [("state", s) for s in states]
        if metadata:
            encoded = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()}
            params.append(("metadata", urllib.parse.urlencode(encoded)))
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = params + ([("nextToken", token)] if token else [])
            resp = self.request("GET", "/v2/sandboxes", params=page)
            out += resp.json()
            token = resp.headers.get("x-next-token")
            if not token:
                return out


def parse_pairs(pairs: list[str] | None, what: str = "--metadata") -> dict[str, str]:
    """``k=v`` options into a dict; a pair without ``=`` is a usage error (exit 2)."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected key=value, got {pair!r}", param_hint=what)
        out[key] = value
    return out


def delete_each(api: Api, collection: str, ids: list[str], done: str) -> None:
    """``DELETE /{collection}/{id}`` for each id, a line each (``<done> <id>`` or ``error: <id>:
    <message>``); exit 1 if any failed."""
    failed = 0
    for item in ids:
        try:
            api.request("DELETE", f"/{collection}/{item}")
        except CliError as exc:
            failed += 1
            typer.echo(f"error: {item}: {exc.message}", err=True)
        else:
            typer.echo(f"{done} {item}")
    if failed:
        raise typer.Exit(1)


def delete_templates(template_ids: list[str]) -> None:
    """``DELETE /templates/{id}`` for each (in E2B a snapshot is a template too)."""
    with reported(), Api() as api:
        delete_each(api, "templates", template_ids, "deleted")


@contextmanager
def reported() -> Iterator[None]:
    """Turn API and SDK errors into one line on stderr and exit 1, never a traceback."""
    from e2b.exceptions import AuthenticationException, SandboxException

    try:
        yield
    except CliError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    except (SandboxException, AuthenticationException) as exc:  # the SDK's kinds (NotFound, Timeout...)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        raise typer.Exit(130) from None


def run(fn: Callable[[], T]) -> T:
    with reported():
        return fn()
