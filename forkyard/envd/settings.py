"""envd's own settings: command-line flags over ``FORKYARD_ENVD_*`` environment variables.

envd must not import :mod:`forkyard.config` (it pulls pydantic-settings, too heavy for the
read-only in-sandbox bundle); the constants it shares with the host come from
:mod:`forkyard.types`, which imports nothing of the project and ships in the bundle.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from forkyard.types import (
    ENVD_ACCESS_TOKEN_ENV,
    ENVD_DEFAULT_WORKDIR_ENV,
    ENVD_ENVS_FILE_ENV,
    ENVD_FILES_AS_USER_ENV,
    ENVD_PORT,
    ENVD_VERSION,
)

#: Prefix of envd's configuration variables (the token's among them): state.py keeps them out of the
#: processes envd starts.
ENV_PREFIX = "FORKYARD_ENVD_"


@dataclass
class EnvdSettings:
    host: str = "0.0.0.0"
    port: int = ENVD_PORT
    access_token: str | None = None
    log_level: str = "warning"
    #: Set the guest clock from ``/init``'s timestamp. Off by default: envd run on a host (tests,
    #: development) must never move the host's clock. gVisor refuses clock_settime anyway.
    sync_clock: bool = False
    #: Output a process stream may hold for a client that reads slower than the process writes.
    stream_buffer_mib: int = 32
    #: File operations with the rights of the request's user (ours) instead of as root with what
    #: is created given to the user (E2B's envd, the default).
    files_as_user: bool = False
    #: Where commands start by default (the template's final WORKDIR); None: the user's home.
    #: ``POST /init``'s ``defaultWorkdir`` replaces it.
    default_workdir: str | None = None
    #: A file envd keeps the sandbox's environment variables in (``forkyard.types.ENVD_ENVS_FILE_ENV``);
    #: None: none (envd run on a host).
    envs_file: str | None = None


def parse_settings(argv: list[str] | None = None) -> EnvdSettings:
    env, defaults = os.environ, EnvdSettings()
    parser = argparse.ArgumentParser(prog="envd", description="forkyard in-sandbox daemon (E2B envd)")
    parser.add_argument("--host", default=env.get("FORKYARD_ENVD_HOST", defaults.host))
    parser.add_argument("--port", type=int, default=int(env.get("FORKYARD_ENVD_PORT", defaults.port)))
    parser.add_argument("--access-token", default=env.get(ENVD_ACCESS_TOKEN_ENV) or None)
    parser.add_argument("--log-level", default=env.get("FORKYARD_ENVD_LOG_LEVEL", defaults.log_level))
    parser.add_argument(
        "--sync-clock",
        action="store_true",
        default=env.get("FORKYARD_ENVD_SYNC_CLOCK", "").lower() in ("1", "true", "yes"),
        help="set the clock from POST /init's timestamp when it is allowed (microVM guests)",
    )
    parser.add_argument(
        "--stream-buffer-mib",
        type=int,
        default=int(env.get("FORKYARD_ENVD_STREAM_BUFFER_MIB", defaults.stream_buffer_mib)),
        help="output held per process stream for a slow client before the process is slowed down",
    )
    parser.add_argument(
        "--files-as-user",
        action="store_true",
        default=env.get(ENVD_FILES_AS_USER_ENV, "").lower() in ("1", "true", "yes"),
        help="file operations with the rights of the request's user (default: as root, as E2B's envd)",
    )
    parser.add_argument(
        "--default-workdir",
        default=env.get(ENVD_DEFAULT_WORKDIR_ENV) or None,
        help="default directory of commands (the template's WORKDIR); default: the user's home",
    )
    parser.add_argument(
        "--envs-file",
        default=env.get(ENVD_ENVS_FILE_ENV) or None,
        help="keep the sandbox's environment variables (POST /init's) in this JSON file",
    )
    parser.add_argument("--version", action="version", version=ENVD_VERSION)
    args = parser.parse_args(argv)
    return EnvdSettings(
        host=args.host,
        port=args.port,
        access_token=args.access_token,
        log_level=args.log_level,
        sync_clock=args.sync_clock,
        stream_buffer_mib=max(1, args.stream_buffer_mib),
        files_as_user=args.files_as_user,
        default_workdir=args.default_workdir,
        envs_file=args.envs_file,
    )
