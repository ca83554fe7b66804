"""The code-execution server of the ``code-interpreter-v1`` template (port 49999 inside the sandbox).

It speaks the protocol of the published ``e2b-code-interpreter`` (PyPI) and ``@e2b/code-interpreter``
(npm) SDKs: ``POST /execute`` streams NDJSON lines (``number_of_executions``, ``stdout``, ``stderr``,
``result``, ``error``, ``end_of_execution``, ``keepalive``), ``/contexts`` creates, lists, restarts and
deletes execution contexts (one Jupyter kernel each). Kernels are driven with ``jupyter_client``
directly: no Jupyter server.

This package runs inside the sandbox, copied alone into the template (``/opt/forkyard/interpreter``,
started as ``python3 -m interpreter``): it imports nothing of ``forkyard`` (relative imports only),
which an import-linter contract checks.
"""

from __future__ import annotations

PORT = 49999
ENVD_PORT = 49983
#: Where envd keeps the sandbox's environment variables (``forkyard.types.SANDBOX_ENVS_FILE``: this
#: package imports nothing of forkyard; a unit test checks the two agree).
ENVS_FILE = "/run/forkyard/envs.json"
