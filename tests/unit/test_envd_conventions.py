"""Pure parts of issue 24's in-sandbox items: sudo's command line and environment, the proxy's end of
a cut Connect stream, the names error messages show, envd's default file mode."""

from __future__ import annotations

import pytest

from forkyard.envd.filesystem.tempnames import temp_upload_name
from forkyard.envd.http.files import _shown_path
from forkyard.envd.process import sudo_args
from forkyard.envd.settings import parse_settings


@pytest.mark.parametrize(
    ("argv", "user", "flags", "command"),
    [
        (["apt-get", "install", "-y", "git"], "root", set(), ["apt-get", "install", "-y", "git"]),
        (["-u", "bob", "id", "-un"], "bob", set(), ["id", "-un"]),
        (["-iu", "bob"], "bob", {"login"}, []),
        (["-Eu", "bob", "env"], "bob", {"preserve_env"}, ["env"]),
        (["-n", "--", "-weird-name"], "root", {"non_interactive"}, ["-weird-name"]),
        (["--user=bob", "--login", "true"], "bob", {"login"}, ["true"]),
        (["sh", "-c", "echo -u"], "root", set(), ["sh", "-c", "echo -u"]),
    ],
)
def test_sudo_command_lines(argv: list[str], user: str, flags: set[str], command: list[str]) -> None:
    line = sudo_args.parse(argv)
    assert (line.user, line.flags, line.command) == (user, flags, command)


def test_sudo_assignments_and_refusals() -> None:
    line = sudo_args.parse(["-E", "A=1", "B=x=y", "env", "C=3"])
    assert line.assignments == {"A": "1", "B": "x=y"} and line.command == ["env", "C=3"]
    with pytest.raises(sudo_args.SudoUsageError, match="invalid option -- 'x'"):
        sudo_args.parse(["-x", "true"])
    with pytest.raises(sudo_args.SudoUsageError, match="requires an argument"):
        sudo_args.parse(["-u"])


def test_sudo_environment() -> None:
    caller_env = {"PATH": "/home/user/bin:/usr/bin", "FOO": "bar", "TERM": "xterm", "LC_ALL": "C.UTF-8"}
    target, caller = ("root", "/root", "/bin/bash"), ("user", 1000, 1000)
    reset = sudo_args.command_env(caller_env, sudo_args.parse(["env"]), target, caller)
    assert "FOO" not in reset and reset["TERM"] == "xterm" and reset["LC_ALL"] == "C.UTF-8"
    assert reset["PATH"] == sudo_args.SECURE_PATH and reset["HOME"] == "/root"
    assert (reset["SUDO_USER"], reset["SUDO_UID"], reset["SUDO_COMMAND"]) == ("user", "1000", "env")
    kept = sudo_args.command_env(caller_env, sudo_args.parse(["-E", "env"]), target, caller)
    assert kept["FOO"] == "bar" and kept["PATH"] == sudo_args.SECURE_PATH  # secure_path even with -E
    some = sudo_args.command_env(
        caller_env, sudo_args.parse(["--preserve-env=FOO,PATH", "env"]), target, caller
    )
    assert some["FOO"] == "bar" and some["PATH"] == caller_env["PATH"]
    assert sudo_args.shell_command("/bin/bash", ["echo", "a b"], login=True) == [
        "/bin/bash",
        "-l",
        "-c",
        "echo 'a b'",
    ]


def test_messages_name_the_target_not_the_upload_temp_file() -> None:
    temp = "/root/" + temp_upload_name("x.txt", replacing=False)
    assert _shown_path(temp) == "/root/x.txt"
    assert _shown_path("/etc/hostname") == "/etc/hostname"


def test_envd_files_default_to_root_and_the_template_workdir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORKYARD_ENVD_FILES_AS_USER", raising=False)
    monkeypatch.delenv("FORKYARD_ENVD_DEFAULT_WORKDIR", raising=False)
    settings = parse_settings([])
    assert settings.files_as_user is False and settings.default_workdir is None
    monkeypatch.setenv("FORKYARD_ENVD_FILES_AS_USER", "1")
    monkeypatch.setenv("FORKYARD_ENVD_DEFAULT_WORKDIR", "/srv/app")
    settings = parse_settings([])
    assert settings.files_as_user is True and settings.default_workdir == "/srv/app"
