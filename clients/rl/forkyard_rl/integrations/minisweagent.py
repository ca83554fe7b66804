"""mini-swe-agent on an E2B-compatible sandbox (forkyard, or E2B itself).

mini-swe-agent's released versions ship no E2B environment, but every place that makes one takes
an import path (``environment_class``), so this class plugs in unchanged (SkyRL and NeMo-Gym run
mini-swe-agent the same way)::

    environment:
      environment_class: forkyard_rl.integrations.minisweagent.E2BEnvironment
      image: python:3.12            # an OCI image, as for its docker environment
      cwd: /testbed

The image becomes an E2B template built ``from_image`` on first use (the SDK's
``Template().from_image(...)`` and ``Template.build``: any E2B-compatible build API), named after
the image, and is reused afterwards; ``template=`` names an existing template instead.
Commands go through the SDK (``commands.run``), as ``root`` in ``cwd`` by default: what
``docker exec`` does in most images. The connection is the SDK's (``E2B_API_URL``,
``E2B_API_KEY``, ...).

:meth:`E2BEnvironment.fork` gives ``count`` environments forked from this one's sandbox (memory,
processes and files), each with its own sandbox: a GRPO group's rollouts from one prepared state.

Only ``e2b`` is imported at module load; ``minisweagent`` is imported when an action submits.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import threading
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from e2b import Sandbox

#: mini-swe-agent's end-of-task marker (its docker environment's ``_check_finished``).
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TEMPLATE_PREFIX = "mswea-"
#: One build per template name at a time in this process (parallel rollouts share the first one).
_build_locks: dict[str, threading.Lock] = {}
_build_locks_guard = threading.Lock()


@dataclass
class E2BEnvironmentConfig:
    """What the environment takes (mini-swe-agent passes its ``environment`` config as keywords)."""

    #: An OCI image ref, built into a template on first use; or ``template``; or ``sandbox_id``.
    image: str = ""
    #: An existing template (name or ``name:tag``) instead of ``image``.
    template: str = ""
    #: Attach to a running sandbox instead of creating one (not killed by :meth:`cleanup`).
    sandbox_id: str = ""
    #: Working directory of commands (made at build time when the template is made here).
    cwd: str = "/"
    #: Who runs the commands (``docker exec`` without ``-u`` is the image's user: root mostly).
    user: str = "root"
    env: dict[str, str] = field(default_factory=dict)
    #: Host variables copied into each command's environment when set (``env`` wins).
    forward_env: list[str] = field(default_factory=list)
    #: Seconds one command may run.
    timeout: int = 30
    #: Server-side lifetime of the sandbox, seconds (the backstop when this process dies).
    sandbox_timeout: int = 3600
    #: ``["bash", "-c"]`` and the like: the command is its last argument. Empty: the SDK's
    #: own shell (``bash -l -c``, E2B's).
    interpreter: list[str] = field(default_factory=list)
    #: Sandbox metadata (to find the sandboxes of a run with ``Sandbox.list``).
    metadata: dict[str, str] = field(default_factory=dict)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:  # what mini-swe-agent calls
        return asdict(self)


def template_name(image: str, cwd: str) -> str:
    """The template an image is built into: stable for (image, cwd), valid as an E2B name."""
    digest = hashlib.sha256(f"{image}\0{cwd}".encode()).hexdigest()[:24]
    return TEMPLATE_PREFIX + digest


def ensure_template(image: str, cwd: str = "/", **api: Any) -> str:
    """Build ``image`` into a template unless it exists; return the template's name.

    ``api``: the SDK's connection keywords (``api_key``, ``api_url``, ...)."""
    from e2b import Template

    name = template_name(image, cwd)
    with _build_locks_guard:
        lock = _build_locks.setdefault(name, threading.Lock())
    with lock:
        if not Template.exists(name, **api):
            # The cwd is made in the image: ``docker exec -w`` makes a missing one too.
            definition = Template().from_image(image).run_cmd(f"mkdir -p {shlex.quote(cwd)}", user="root")
            Template.build(definition, name, **api)
    return name


class E2BEnvironment:
    """mini-swe-agent's ``Environment`` protocol on one E2B sandbox."""

    def __init__(
        self,
        *,
        config_class: type[E2BEnvironmentConfig] = E2BEnvironmentConfig,
        sandbox: Sandbox | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config_class(**kwargs)
        self._owned = not self.config.sandbox_id
        self._killed = False
        self.sandbox = sandbox if sandbox is not None else self._open()
        self.config.sandbox_id = self.sandbox.sandbox_id

    def _open(self) -> Sandbox:
        from e2b import Sandbox

        cfg = self.config
        if cfg.sandbox_id:
            return Sandbox.connect(cfg.sandbox_id)
        if bool(cfg.image) == bool(cfg.template):
            raise ValueError("E2BEnvironment needs exactly one of image, template and sandbox_id")
        template = cfg.template or ensure_template(cfg.image, cfg.cwd)
        return Sandbox.create(template, timeout=cfg.sandbox_timeout, metadata=cfg.metadata or None)

    # -- mini-swe-agent's protocol ---------------------------------------------------------------

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; stdout and stderr in one text, in the order they came."""
        from e2b import CommandExitException

        command = action.get("command", "")
        chunks: list[str] = []
        try:
            self.sandbox.commands.run(
                shlex.join([*self.config.interpreter, command]) if self.config.interpreter else command,
                cwd=cwd or self.config.cwd,
                user=self.config.user,
                envs=self._envs(),
                timeout=timeout or self.config.timeout,
                on_stdout=chunks.append,
                on_stderr=chunks.append,
            )
            output: dict[str, Any] = {"output": "".join(chunks), "returncode": 0, "exception_info": ""}
        except CommandExitException as exc:
            output = {"output": "".join(chunks), "returncode": exc.exit_code, "exception_info": ""}
        except Exception as exc:  # a timeout, a lost sandbox: the agent sees it, as with docker
            output = {
                "output": "".join(chunks),
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {exc}",
                "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
            }
        self._check_finished(output)
        return output

    def _envs(self) -> dict[str, str]:
        forwarded = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        return {**forwarded, **self.config.env}

    @staticmethod
    def _check_finished(output: dict[str, Any]) -> None:
        """Raise mini-swe-agent's ``Submitted`` when the command printed the submit marker first."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    # -- beyond the protocol ---------------------------------------------------------------------

    def fork(self, count: int, *, sandbox_timeout: int | None = None) -> list[E2BEnvironment]:
        """``count`` environments forked from this one's sandbox, each owning its own sandbox.
        All or nothing: when one fork fails the others are killed and the error raised."""
        made = self.sandbox.fork(timeout=sandbox_timeout or self.config.sandbox_timeout, count=count)
        errors = [m for m in made if isinstance(m, Exception)]
        children = [m for m in made if not isinstance(m, Exception)]
        if errors:
            for child in children:
                child.kill()
            raise errors[0]
        envs = []
        for child in children:
            settings = {**self.config.model_dump(), "sandbox_id": ""}
            env = type(self)(config_class=type(self.config), sandbox=child, **settings)
            envs.append(env)
        return envs

    def cleanup(self) -> None:
        """Kill the sandbox when this environment made it (not one it attached to)."""
        sandbox = getattr(self, "sandbox", None)  # None when __init__ failed
        if sandbox is not None and self._owned and not self._killed:
            self._killed = True
            try:
                sandbox.kill()
            except Exception:  # already gone: its server-side timeout is the backstop anyway
                pass

    def __del__(self) -> None:
        self.cleanup()
