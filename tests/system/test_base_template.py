"""The ``base`` template has what E2B's base template gives agent code (python:3.11 with Node.js,
npm and yarn on Debian bookworm), through the official SDK: compilers, Python with pip and venv,
Node.js with npm and yarn, git, gh, curl, wget; ``sudo`` and documentation-free package installs are
other tests'. Runs against the shared ``base`` (``FORKYARD_TEMPLATES_PATH``); one built from an
older recipe fails here until ``forkyard template build base`` rebuilds it (``make test`` does).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox

from forkyard.config import Settings
from forkyard.storage import templates as storage
from tests.support import SHARED_TEMPLATES, base_template_missing
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("sandboxes")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with serve(prefix="forkyard-base-") as srv:
        yield srv


def test_the_shared_base_is_built_from_the_current_recipe() -> None:
    settings = Settings(templates_path=SHARED_TEMPLATES)
    assert storage.is_current("base", settings), "rebuild it: forkyard template build base"


def test_base_has_what_e2b_base_has(server: ServerProcess) -> None:
    sbx = Sandbox.create("base", timeout=300, **server.sdk_opts)
    try:
        for command, expected in (
            ("node --version", "v"),
            ("npm --version", ""),
            ("yarn --version", "1."),
            ("gcc --version", "gcc"),
            ("make --version", "GNU Make"),
            ("python --version", "Python 3."),
            ("pip --version", "pip "),
            ("git --version", "git version"),
            ("gh --version", "gh version"),
            ("curl --version", "curl "),
            ("wget --version", "GNU Wget"),
        ):
            result = sbx.commands.run(command, timeout=120)
            assert result.exit_code == 0 and result.stdout.startswith(expected), (command, result)
        # Building native code and a venv work as the default user.
        sbx.files.write("/home/user/hello.c", '#include <stdio.h>\nint main(){puts("compiled");}\n')
        out = sbx.commands.run("cd ~ && gcc hello.c -o hello && ./hello && python -m venv v && v/bin/pip -V")
        assert out.stdout.startswith("compiled\npip "), out
        node = sbx.commands.run("node -e 'console.log(require(\"os\").platform())'")
        assert node.stdout.strip() == "linux"
    finally:
        sbx.kill()
