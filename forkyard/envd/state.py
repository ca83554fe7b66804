"""envd's mutable state: what ``POST /init`` set (env vars, token, default user and workdir)."""

from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from forkyard.envd.settings import ENV_PREFIX
from forkyard.envd.users import User, default_user_name, lookup_user
from forkyard.types import DEFAULT_PATH

logger = logging.getLogger("forkyard.envd")


@dataclass
class EnvdState:
    access_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    default_user: str | None = None
    default_workdir: str | None = None
    #: Where :meth:`set_env_vars` keeps the variables for readers in the sandbox (settings.py).
    envs_file: str | None = None

    def set_env_vars(self, env_vars: dict[str, str]) -> None:
        """``/init``'s variables over the earlier ones; the file is rewritten when they changed."""
        changed = any(self.env_vars.get(k) != v for k, v in env_vars.items())
        self.env_vars.update(env_vars)
        if changed:
            self.publish_env_vars()

    def publish_env_vars(self) -> None:
        """Write the variables to ``envs_file``, atomically (a reader sees the old file or the new
        one, and a new inode: its ``stat`` tells the change), readable by every user in the sandbox
        as ``/envs`` is open to every local process."""
        if not self.envs_file:
            return
        path = Path(self.envs_file)
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.env_vars))
            tmp.chmod(0o644)
            os.replace(tmp, path)
        except OSError as exc:  # the interpreter then asks /envs instead
            logger.warning("could not write %s: %s", path, exc)

    def token_matches(self, presented: str | None) -> bool:
        if not self.access_token:
            return True
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.access_token.encode())

    def user(self, requested: str | None) -> User:
        """The named user, or the default one; raises Unauthenticated for an unknown one."""
        return lookup_user(requested or default_user_name(self.default_user))

    def workdir(self, user: User) -> str:
        return self.default_workdir or user.home

    def command_cwd(self, user: User) -> str:
        """Where a command without a cwd starts. A user without a home (nobody: /nonexistent)
        still gets to run commands."""
        default = self.workdir(user)
        return default if os.path.isdir(default) else "/"

    def process_env(self, user: User, overrides: dict[str, str]) -> dict[str, str]:
        """envd's environment < user identity < ``/init`` envVars < the request's envs."""
        # envd's own configuration (its access token among it) must not leak into user processes.
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env.setdefault("PATH", DEFAULT_PATH)
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name, SHELL=user.shell)
        env.update(self.env_vars)
        env.update(overrides)
        return env
