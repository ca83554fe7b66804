"""The ``code-interpreter-v1`` template: E2B's code interpreter, built here from Debian, PyPI and npm.

A build of the template builder (:mod:`forkyard.orchestrator.builder`) from ``base``: the kernels
(ipykernel, tslab's JavaScript and TypeScript kernels, bash_kernel, Debian's IRkernel, JJava on
Debian's JDK), the data-science stack of E2B's template, and our code-execution server
(:mod:`forkyard.interpreter`, copied in alone) as the start command, kept running by its
supervisor (``supervise.sh``, a shell loop). The template's snapshot is taken with the server and a
warm Python kernel running, so a create restores them. Each step is cached (the builder's step
layers): a rebuild after a change of the server's code only repeats the last steps.

A host behind a TLS-inspecting proxy trusts CAs of its own (``/usr/local/share/ca-certificates``):
they are copied into the template too, or nothing in it could reach PyPI and npm.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from forkyard import interpreter
from forkyard.config import Settings
from forkyard.orchestrator.builder import Build, BuildSpec, BuildStep, TemplateBuilder
from forkyard.storage import templates as storage
from forkyard.storage.atomic import write_json_atomic

logger = logging.getLogger("forkyard.code_interpreter")

TEMPLATE_ID = "code-interpreter-v1"
#: Where the server's package lands (``python3 -m interpreter`` from here).
SERVER_DIR = "/opt/forkyard"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
INTERPRETER_PORT = interpreter.PORT
#: E2B's template runs on 2 vCPUs and 1 GiB; kernels of five languages and a pandas cell need it.
CPU_COUNT = 2
MEMORY_MB = 1024

DEBIAN_PACKAGES = (
    "python3-pip",
    "python3-dev",
    "build-essential",
    "nodejs",
    "npm",
    "r-base-core",
    "r-cran-irkernel",
    "default-jdk-headless",
    "fonts-dejavu-core",
)
#: Pinned: the kernels, the server's own dependencies, E2B's data-science stack.
PYTHON_PACKAGES = (
    "ipykernel==7.4.0",
    "ipython==9.19.1",
    "jupyter_client==8.10.0",
    "jupyter_core==5.9.1",
    "pyzmq==27.3.0",
    "starlette==1.10.0",
    "uvicorn==0.55.0",
    "numpy==2.4.6",
    "pandas==3.1.1",
    "matplotlib==3.11.2",
    "scipy==1.17.1",
    "scikit-learn==1.9.1",
    "seaborn==0.13.2",
    "plotly==7.1.0",
    "requests==2.34.2",
    "e2b-charts==1.0.0",
    "bash_kernel==0.10.0",
    "jjava==1.0a8",
)
NPM_PACKAGES = ("tslab@1.0.22",)

_APT = (
    "export DEBIAN_FRONTEND=noninteractive && apt-get update -q && "
    f"apt-get install -y -q --no-install-recommends {' '.join(DEBIAN_PACKAGES)} && "
    "rm -rf /var/lib/apt/lists/*"
)
# The template is the user's machine: `pip install` (and `!pip install` in a cell) may change
# the system's Python, as in E2B's template (Debian marks it externally managed).
_PIP = (
    "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && "
    f"python3 -m pip install --no-cache-dir -q {' '.join(PYTHON_PACKAGES)} && "
    "python3 -m bash_kernel.install --sys-prefix && "
    "R -q -e 'IRkernel::installspec(user = FALSE, prefix = \"/usr/local\")'"
)
_NPM = (
    f"npm install -g --no-audit --no-fund {' '.join(NPM_PACKAGES)} && "
    "tslab install --prefix /usr/local && npm cache clean --force"
)
_CERTS = (
    f"if ls {SERVER_DIR}/certs/*.crt >/dev/null 2>&1; then "
    f"cp {SERVER_DIR}/certs/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; fi"
)
_CHECK = "jupyter kernelspec list && node --version && R --version | head -1 && java -version"
_USER_SITE = 'mkdir -p "$(python3 -m site --user-site)"'
START_CMD = f"exec sh {SERVER_DIR}/interpreter/supervise.sh >> /tmp/forkyard-interpreter.log 2>&1"
READY_CMD = f"curl -sf http://127.0.0.1:{INTERPRETER_PORT}/health"


def server_archive() -> bytes:
    """The server's package (no caches), as ``interpreter/``."""
    package = Path(interpreter.__file__).parent
    files = [p for p in sorted(package.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return _archive({f"interpreter/{p.relative_to(package)}": p.read_bytes() for p in files})


def certs_archive() -> bytes:
    """The host's own CAs (maybe none), as ``certs/``."""
    found = sorted(HOST_CA_DIR.glob("*.crt")) if HOST_CA_DIR.is_dir() else []
    return _archive({f"certs/{cert.name}": cert.read_bytes() for cert in found} or {"certs/.none": b""})


def _archive(files: dict[str, bytes]) -> bytes:
    """Fixed times and owners: the archive's hash (the step's cache key) follows the content."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def build_spec(certs_hash: str, server_hash: str) -> BuildSpec:
    # The slow steps come first, the server's code last: a change of the code reuses them.
    steps = [
        BuildStep("COPY", [".", f"{SERVER_DIR}/", "root", ""], certs_hash),
        BuildStep("RUN", [_CERTS, "root"]),
        BuildStep("RUN", [_APT, "root"]),
        BuildStep("RUN", [_PIP, "root"]),
        BuildStep("RUN", [_NPM, "root"]),
        BuildStep("RUN", [_CHECK, "root"]),
        BuildStep("COPY", [".", f"{SERVER_DIR}/", "root", ""], server_hash),
        # `!pip install x` in a cell installs into the user's site (the system's is root's); a
        # kernel puts that directory on sys.path only if it exists when the kernel starts.
        BuildStep("RUN", [_USER_SITE, "user"]),
    ]
    return BuildSpec(from_template="base", steps=steps, start_cmd=START_CMD, ready_cmd=READY_CMD)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _stage(builder: TemplateBuilder, data: bytes) -> str:
    files_hash = hashlib.sha256(data).hexdigest()
    await builder.store_upload(files_hash, _once(data))
    return files_hash


def current_spec() -> BuildSpec:
    """The spec as the code here says, its files hashed but not staged."""
    return build_spec(
        hashlib.sha256(certs_archive()).hexdigest(), hashlib.sha256(server_archive()).hexdigest()
    )


def is_current(builder: TemplateBuilder, settings: Settings) -> bool:
    """Built from this very spec (server code, packages, the parent's current build): a template
    built from older code is rebuilt (its unchanged steps come from the step cache)."""
    if not is_built(settings):
        return False
    wanted = builder.final_layer_key(current_spec())
    return wanted is not None and storage.read_metadata(TEMPLATE_ID, settings).get("layer_key") == wanted


async def prepare(builder: TemplateBuilder) -> tuple[Build, BuildSpec]:
    """A build of the template, its files staged; the caller runs it (``builder.run``) or starts
    it in the background (``builder.start``)."""
    spec = build_spec(await _stage(builder, certs_archive()), await _stage(builder, server_archive()))
    builder.check_spec(spec)
    build = builder.request(TEMPLATE_ID, [], CPU_COUNT, MEMORY_MB)
    return build, spec


def is_built(settings: Settings) -> bool:
    return storage.is_built(TEMPLATE_ID, settings)


def progress_path(settings: Settings) -> Path:
    return settings.data_dir / f"{TEMPLATE_ID}.building.json"


def write_progress(settings: Settings, build_id: str, step: str, message: str) -> None:
    """The server's background build, for ``forkyard template list`` (another process)."""
    record = {"build_id": build_id, "step": step, "message": message[:300], "pid": os.getpid()}
    record["at"] = time.time()
    with contextlib.suppress(OSError):
        write_json_atomic(progress_path(settings), record)


def build_progress(settings: Settings) -> dict[str, Any] | None:
    """The last progress a live server wrote for a build not finished yet, None otherwise."""
    if is_built(settings):
        return None
    try:
        record: dict[str, Any] = json.loads(progress_path(settings).read_text())
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record
