"""Who a request acts as, and where its relative paths point.

The SDK names the user in ``Authorization: Basic base64("<user>:")`` on RPCs (e2b/envd/utils.py
``authentication_header``) and in the ``username`` query parameter on ``/files``. No header means
"the sandbox's default user".
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import pwd
from dataclasses import dataclass

from forkyard.errors import Invalid, Unauthenticated
from forkyard.types import SANDBOX_USER


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @functools.cached_property
    def groups(self) -> tuple[int, ...]:
        """Read once per lookup (each request looks its user up anew): getgrouplist parses
        /etc/group, which every command needs two or three times."""
        try:
            return tuple(os.getgrouplist(self.name, self.gid))
        except OSError:
            return (self.gid,)


def lookup_user(name: str) -> User:
    """Raises Unauthenticated for a user the sandbox does not have (401 / ``unauthenticated``, as
    E2B's envd answers)."""
    try:
        entry = pwd.getpwnam(name)
    except (KeyError, ValueError):  # ValueError: a NUL in the name, which no account has
        raise Unauthenticated(f"error looking up user '{name}': user: unknown user {name}") from None
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", entry.pw_shell or "/bin/sh")


def default_user_name(configured: str | None) -> str:
    """``/init``'s ``defaultUser`` if set, else ``user`` when the template has it, else root."""
    if configured:
        return configured
    try:
        pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        return "root"
    return SANDBOX_USER


def username_from_authorization(header: str | None) -> str | None:
    """The user named by an ``Authorization: Basic`` header, or None when there is none."""
    if not header:
        return None
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() != "basic":
        raise Unauthenticated(f"unsupported authorization scheme '{scheme}', expected Basic")
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise Unauthenticated("invalid Basic authorization header") from None
    name = decoded.partition(":")[0]
    return name or None


def resolve_path(path: str, user: User) -> str:
    """Absolute, normalised path; relative paths and ``~`` resolve against the user's home.
    Raises Invalid for a path no file can have (a NUL byte: the kernel's paths are C strings)."""
    if "\0" in path:
        raise Invalid(f"path {path!r} contains a NUL byte")
    if path == "~":
        path = user.home
    elif path.startswith("~/"):
        path = os.path.join(user.home, path[2:])
    elif not path.startswith("/"):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)
