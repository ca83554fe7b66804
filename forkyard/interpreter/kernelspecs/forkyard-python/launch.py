"""The Python kernel: ipykernel as ``python -m ipykernel_launcher`` starts it, without its debugger.

ipykernel creates a debugpy debugger (Jupyter's visual debugger, through the control channel) in
every kernel when debugpy is importable, loading ~100 modules of debugpy and pydevd: ~20 MB of
every idle sandbox's memory for a feature E2B's SDKs never use. Hiding debugpy while ipykernel
starts leaves it without one; the start-up file (ipython_startup.py) makes debugpy importable
again for the user's own cells. ``python3`` in kernel.json is the server's Python (jupyter_client
puts its own executable there).
"""

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # this kernelspec's directory: not the user's import path
sys.modules["debugpy"] = None  # type: ignore[assignment]  # ImportError for ipykernel's probe

from ipykernel import kernelapp  # noqa: E402

kernelapp.launch_new_instance()
