"""Keeps modules and libraries envd never uses out of its process (and so out of every
checkpoint image).

Every pause, snapshot and fork checkpoints envd's memory, and inside gVisor each shared library
envd maps counts in full (the sentry keeps mapped file pages in its own memory and saves them).
The biggest such library is one envd has no use for: connectrpc's gRPC protocol module imports
``pyqwest.Headers`` at import time for its *client* side, which maps pyqwest's 16 MB Rust HTTP
client (12 MB of mappings) into a process that only ever serves the Connect protocol. uvicorn's
package ``__init__`` imports its command line (click) and process supervisors (multiprocessing).

Only envd's own entry point (:func:`forkyard.envd.server.main`) uses these: a process that
imports envd's modules for other reasons gets the libraries as they are.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from uvicorn.config import Config
    from uvicorn.server import Server

_HTTP_CLIENT = "pyqwest"


def _real_http_client() -> types.ModuleType:
    """Swap the placeholder for the real module on first use (keeps every code path working)."""
    current = sys.modules.get(_HTTP_CLIENT)
    if isinstance(current, _Placeholder):
        del sys.modules[_HTTP_CLIENT]
    return importlib.import_module(_HTTP_CLIENT)


class _Placeholder(types.ModuleType):
    """Stands in for pyqwest until something really uses it: any public attribute loads the real
    module. Dunder lookups (``__path__`` above all: the import system probes it for every
    ``from pyqwest import X``) do not, so the placeholder is a plain module, not a package;
    importing a pyqwest submodule needs the real one loaded first (envd never does)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(_real_http_client(), name)


class _LazyHeaders:
    """What ``from pyqwest import Headers`` binds at import time; constructing one (only connectrpc's
    gRPC client does) loads the real pyqwest and returns its ``Headers``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _real_http_client().Headers(*args, **kwargs)


def defer_http_client() -> None:
    """Import pyqwest only when something uses it (never, in envd). Call before connectrpc is
    imported; a no-op when pyqwest is already loaded (e.g. envd's modules imported in a host
    process that uses connectrpc's client)."""
    if _HTTP_CLIENT in sys.modules:
        return
    placeholder = _Placeholder(_HTTP_CLIENT, "placeholder for pyqwest until it is used (forkyard.envd.lean)")
    placeholder.Headers = _LazyHeaders  # type: ignore[attr-defined]
    sys.modules[_HTTP_CLIENT] = placeholder


class _DeferredInit(types.ModuleType):
    """A package whose ``__init__`` has not run: submodules import normally (``__path__`` is set);
    the first lookup of anything else runs the real ``__init__`` in place, so ``uvicorn.run`` and
    friends still work for whoever asks."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        spec = self.__spec__
        if self.__dict__.get("_forkyard_init_ran") or spec is None or spec.loader is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        self._forkyard_init_ran = True
        spec.loader.exec_module(self)
        return object.__getattribute__(self, name)


def uvicorn_server() -> tuple[type[Config], type[Server]]:
    """uvicorn's ``Config`` and ``Server`` without running ``uvicorn/__init__``.

    That ``__init__`` imports ``uvicorn.main`` (the command line: click, and through the reload
    and worker supervisors multiprocessing, tempfile, shutil, bz2, lzma, email): ~40 modules and
    ~2.3 MB of heap envd never uses, which would be in every checkpoint image. ``uvicorn.run``
    is only a wrapper around ``Config`` + ``Server.run``. When uvicorn is already imported (envd's
    modules in a host process) that module is used as is."""
    if "uvicorn" not in sys.modules:
        spec = importlib.util.find_spec("uvicorn")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("uvicorn is not installed")
        package = _DeferredInit("uvicorn")
        package.__spec__ = spec
        package.__loader__ = spec.loader
        package.__file__ = spec.origin
        package.__package__ = "uvicorn"
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["uvicorn"] = package
        try:
            from uvicorn.config import Config
            from uvicorn.server import Server
        except BaseException:
            del sys.modules["uvicorn"]
            raise
        # What uvicorn's own submodules import from the package (``from uvicorn import Config``
        # in uvicorn.lifespan.on), set without running its __init__.
        package.Config = Config  # type: ignore[attr-defined]
        package.Server = Server  # type: ignore[attr-defined]
    from uvicorn.config import Config
    from uvicorn.server import Server

    return Config, Server
