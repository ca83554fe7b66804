"""``sudo``'s command line, as the sudo broker (sudo.py) understands it.

The subset agent code and templates use: ``-u user``, ``-g group``, ``-E`` /
``--preserve-env[=list]``, ``-i`` / ``-s`` (login or plain shell), ``-H``, ``-D dir``, ``-n``,
``-S``, ``-k`` / ``-K`` / ``-v`` (nothing to do: there is no password), ``-b``, ``-p prompt``,
``-V``, ``-h``, ``-l``, ``VAR=value`` before the command, ``--``. Short options combine as in
sudo (``-iu bob``, ``-Eu bob``). Pure functions: no I/O, so the rules are easy to test.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

SUDO_VERSION = "Sudo version 1.9.13p3 (forkyard envd broker)"
USAGE = (
    "usage: sudo [-bEHiknSs] [-D directory] [-g group] [-p prompt] [-u user] [VAR=value] [-i | -s]"
    " [command [arg ...]]\n"
)
#: Debian's ``secure_path``: PATH of every command sudo runs (even with -E).
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Variables sudo keeps without -E (its default env_keep, Debian's sudoers).
ENV_KEEP = frozenset(
    {"COLORS", "DISPLAY", "HOSTNAME", "LS_COLORS", "PS1", "PS2", "XAUTHORITY", "TERM", "TZ"}
    | {"LANG", "LANGUAGE", "LINGUAS", "LC_ALL", "COLORTERM", "MAIL"}
)
_WITH_VALUE = {"u": "user", "g": "group", "p": "prompt", "D": "chdir", "C": "close_from"}
_LONG_WITH_VALUE = {"user", "group", "prompt", "chdir", "close-from"}
_FLAGS = {
    "E": "preserve_env",
    "H": "set_home",
    "i": "login",
    "s": "shell",
    "n": "non_interactive",
    "S": "stdin",
    "k": "reset_timestamp",
    "K": "remove_timestamp",
    "v": "validate",
    "b": "background",
    "V": "version",
    "l": "list",
    "A": "askpass",
    "P": "preserve_groups",
    "h": "help",
}
_LONG_FLAGS = {
    "preserve-env": "preserve_env",
    "set-home": "set_home",
    "login": "login",
    "shell": "shell",
    "non-interactive": "non_interactive",
    "stdin": "stdin",
    "reset-timestamp": "reset_timestamp",
    "remove-timestamp": "remove_timestamp",
    "validate": "validate",
    "background": "background",
    "version": "version",
    "list": "list",
    "help": "help",
    "askpass": "askpass",
    "preserve-groups": "preserve_groups",
}


class SudoUsageError(ValueError):
    """A command line sudo refuses (exit 1, the message on stderr)."""


@dataclass
class SudoCommandLine:
    user: str = "root"
    group: str | None = None
    chdir: str | None = None
    flags: set[str] = field(default_factory=set)
    #: ``--preserve-env=A,B``: only these (``preserve_env`` in flags: all).
    preserve: set[str] = field(default_factory=set)
    assignments: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)

    def has(self, flag: str) -> bool:
        return flag in self.flags


def parse(argv: list[str]) -> SudoCommandLine:
    """``argv`` without the program name."""
    line = SudoCommandLine()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--"):
            i = _long_option(line, argv, i)
        elif arg.startswith("-") and len(arg) > 1:
            i = _short_options(line, argv, i)
        else:
            break
    rest = argv[i:]
    while rest and "=" in rest[0] and not rest[0].startswith("=") and _is_name(rest[0].partition("=")[0]):
        name, _, value = rest.pop(0).partition("=")
        line.assignments[name] = value
    line.command = rest
    return line


def _is_name(name: str) -> bool:
    return bool(name) and (name[0].isalpha() or name[0] == "_") and all(c.isalnum() or c == "_" for c in name)


def _long_option(line: SudoCommandLine, argv: list[str], i: int) -> int:
    name, eq, value = argv[i][2:].partition("=")
    if name == "preserve-env" and eq:
        line.preserve.update(v for v in value.split(",") if v)
        return i + 1
    if name in _LONG_WITH_VALUE:
        if not eq:
            if i + 1 >= len(argv):
                raise SudoUsageError(f"sudo: option '--{name}' requires an argument\n{USAGE}")
            value, i = argv[i + 1], i + 1
        _set_value(line, name.replace("-", "_"), value)
        return i + 1
    flag = _LONG_FLAGS.get(name)
    if flag is None or eq:
        raise SudoUsageError(f"sudo: unrecognized option '--{name}'\n{USAGE}")
    line.flags.add(flag)
    return i + 1


def _short_options(line: SudoCommandLine, argv: list[str], i: int) -> int:
    arg = argv[i]
    for pos in range(1, len(arg)):
        letter = arg[pos]
        if letter in _WITH_VALUE:
            value = arg[pos + 1 :]
            if not value:
                if i + 1 >= len(argv):
                    raise SudoUsageError(f"sudo: option requires an argument -- '{letter}'\n{USAGE}")
                value, i = argv[i + 1], i + 1
            _set_value(line, _WITH_VALUE[letter], value)
            return i + 1
        flag = _FLAGS.get(letter)
        if flag is None:
            raise SudoUsageError(f"sudo: invalid option -- '{letter}'\n{USAGE}")
        line.flags.add(flag)
    return i + 1


def _set_value(line: SudoCommandLine, name: str, value: str) -> None:
    if name == "user":
        line.user = value
    elif name == "group":
        line.group = value
    elif name == "chdir":
        line.chdir = value
    # prompt, close_from: nothing to do without passwords


def shell_command(shell: str, command: list[str], login: bool) -> list[str]:
    """``-i`` / ``-s``: the shell, a login one for ``-i``, running ``command`` (quoted as sudo
    does, so ``sudo -i echo 'a b'`` prints ``a b``) or interactive without one."""
    argv = [shell, "-l"] if login else [shell]
    if command:
        argv += ["-c", shlex.join(command)]
    return argv


def command_env(
    caller_env: dict[str, str],
    line: SudoCommandLine,
    target: tuple[str, str, str],
    caller: tuple[str, int, int],
) -> dict[str, str]:
    """The command's environment: sudo's env_reset (a few variables kept) or all with ``-E``,
    the target's identity, ``SUDO_*`` naming the caller, ``secure_path``, then ``VAR=value``."""
    name, home, shell = target
    if line.has("preserve_env"):
        env = dict(caller_env)
    else:
        keep = ENV_KEEP | line.preserve
        env = {k: v for k, v in caller_env.items() if k in keep or k.startswith("LC_")}
    env.update(HOME=home, USER=name, LOGNAME=name, SHELL=shell, PATH=SECURE_PATH)
    if "PATH" in line.preserve and "PATH" in caller_env:
        env["PATH"] = caller_env["PATH"]
    caller_name, caller_uid, caller_gid = caller
    env.update(SUDO_USER=caller_name, SUDO_UID=str(caller_uid), SUDO_GID=str(caller_gid))
    env["SUDO_COMMAND"] = " ".join(line.command)[:4096] if line.command else shell
    env.update(line.assignments)
    return env
