"""The envd runtime bundle: a self-contained python + envd that runs inside ANY root file system.

A template may have no python, another python, or another libc. So envd does not use anything
of the sandbox's root file system: the host's interpreter, a pruned standard library, the few
site-packages envd imports, the ``forkyard.envd`` source with the project modules it shares with
the host (:data:`SHARED_MODULES`) and every shared library (plus glibc's dynamic loader) are
copied into one directory that runtimes mount read-only at ``/.forkyard``::

    {data_dir}/envd-runtime/<hash>/
        bin/python3        host interpreter; PT_INTERP and RUNPATH point into /.forkyard/lib
        bin/envd           launcher script (``#!/.forkyard/bin/python3 -I``), needs no /bin/sh
        bin/sudo           sudo through envd's broker (envd/process/sudo.py), for gVisor
        lib/               ld-linux-x86-64.so.2, libc.so.6, libpython3.11.so.1.0, libssl, ...
        lib/python3.11/    stdlib (no tests, idle, tkinter, ...), lib-dynload, site-packages
                           (Debian's python: lib/python3/dist-packages, :func:`bundle_site_rel`)
        manifest.json      what went in (inputs of the hash, library list, sizes)

``<hash>`` is derived from the envd source, the installed distributions, the interpreter and
this builder, so editing envd or upgrading a dependency yields a new bundle while running
sandboxes keep theirs. Building happens in a temporary directory renamed into place (readers
never see a partial bundle) under an exclusive ``flock`` (concurrent builders wait for, then
reuse, the first one's result).

Python finds its prefix from ``argv[0]`` (``/.forkyard/bin/python3`` -> the landmark
``/.forkyard/lib/python3.11/os.py``), which is why envd runs with ``-I``: neither PYTHONHOME
nor PYTHONPATH is needed, and none leak into the processes envd starts for the user (a
PYTHONHOME pointing at the bundle would break the template's own python).
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import Settings
from forkyard.storage.atomic import exclusive
from forkyard.types import DEFAULT_PATH, ENVD_PORT

#: Where runtimes mount the bundle inside a sandbox.
MOUNT_POINT = "/.forkyard"
#: The bundle's sudo client, ``bin/sudo`` (mounted over a template's /usr/bin/sudo under gVisor).
SUDO_SHIM = "sudo"
LOADER_NAME = "ld-linux-x86-64.so.2"
#: Bump to force a rebuild when the layout changes in a way the builder source hash misses.
BUNDLE_FORMAT = 1
#: The modules of the ``forkyard`` package envd imports besides ``forkyard.envd``: the contract
#: constants and the error vocabulary (both import nothing of the project). The closure check
#: refuses a bundle whose envd imports any other.
SHARED_MODULES = ("__init__.py", "types.py", "errors.py")

PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
STDLIB_REL = f"lib/python{PY_VERSION}"

#: Top-level stdlib entries envd never needs (big, or only for humans / building python).
STDLIB_PRUNE = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "turtle.py",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "site-packages",
    "distutils",
    "venv",
    "__phello__",
    "dist-packages",
}
#: Nested directories pruned wherever they occur in the stdlib.
STDLIB_PRUNE_NESTED = {"test", "tests", "idle_test"}
#: Extension modules in lib-dynload that are test helpers or need X11/Tk.
DYNLOAD_PRUNE = re.compile(r"^(_test|_ctypes_test|_tkinter|xxlimited|_xxtestfuzz|_xxsubinterpreters)")
#: glibc's own objects: copied verbatim (they already resolve among themselves).
GLIBC_LIBS = re.compile(r"^(ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libutil\.so)")
#: Loaded by glibc with dlopen (thread cancellation/exit unwinding), so ldd cannot see it.
DLOPENED_LIBS = ("libgcc_s.so.1",)
#: Imported only when the server starts (uvicorn's import_from_string / lazy protocol loading), or
#: only on a rare path: pyqwest stays on disk for connectrpc's gRPC code but is not loaded at
#: start-up (forkyard.envd.lean). No websockets: envd runs uvicorn with ``ws="none"``.
RUNTIME_LAZY_MODULES = (
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.lifespan.on",
    "uvicorn.loops.asyncio",
    "uvicorn.loops.auto",
    "pyqwest",
)


class BundleError(Exception):
    """The envd bundle could not be built."""


@dataclass(frozen=True)
class HostPython:
    executable: Path
    stdlib: Path
    site_packages: tuple[Path, ...]


def host_python() -> HostPython:
    base = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = tuple(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    return HostPython(executable=base, stdlib=stdlib, site_packages=site)


def envd_source_dir() -> Path:
    import forkyard.envd

    return Path(forkyard.envd.__file__).parent


def _bundled_sources() -> list[Path]:
    """Every project source file the bundle ships: ``forkyard.envd`` and the shared modules."""
    package = envd_source_dir().parent
    return sorted([*(package / name for name in SHARED_MODULES), *envd_source_dir().rglob("*.py")])


# -- identity ----------------------------------------------------------------------------------


#: fingerprint -> bundle hash, for this process (see :func:`bundle_hash`).
_HASHES: dict[tuple[object, ...], str] = {}


def _fingerprint(py: HostPython) -> tuple[object, ...]:
    """What would change the bundle hash, read with ``stat`` only: the bundled sources, the
    interpreter, and the directories Python finds distributions in (installing, upgrading or
    removing one adds or removes a ``.dist-info`` there)."""
    paths = [Path(__file__), py.executable, *_bundled_sources()]
    paths += [Path(entry) for entry in sys.path if entry and os.path.isdir(entry)]
    stamps: list[object] = [str(py.executable), sys.version]
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            stamps.append((str(path), None))
            continue
        stamps.append((str(path), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stamps)


def bundle_hash(py: HostPython | None = None) -> str:
    """Content hash of everything that goes into the bundle. Every create and restore asks for
    it: hashed once per fingerprint (reading every distribution's metadata took ~110 ms of the
    server's CPU per restore, three quarters of it in a fork of 16)."""
    py = py or host_python()
    key = _fingerprint(py)
    digest = _HASHES.get(key)
    if digest is None:
        _HASHES.clear()  # the old fingerprint will not come back
        digest = _HASHES[key] = _content_hash(py)
    return digest


def _content_hash(py: HostPython) -> str:
    h = hashlib.sha256()
    h.update(f"format={BUNDLE_FORMAT}\n".encode())
    h.update(Path(__file__).read_bytes())
    st = py.executable.stat()
    h.update(f"{py.executable}:{st.st_size}:{st.st_mtime_ns}:{sys.version}\n".encode())
    package = envd_source_dir().parent
    for path in _bundled_sources():
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    dists = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] and d.metadata["Name"] != "forkyard"
    )
    h.update("\n".join(dists).encode())
    return h.hexdigest()[:16]


def bundle_root(settings: Settings) -> Path:
    return settings.data_dir / "envd-runtime"


# -- how runtimes start envd --------------------------------------------------------------------


def envd_argv(host: str = "0.0.0.0", port: int = ENVD_PORT, mount_point: str = MOUNT_POINT) -> list[str]:
    """Command line that starts envd from a bundle mounted at ``mount_point``.

    The loader is named explicitly (not only through PT_INTERP) so that the interpreter runs
    even where the kernel would resolve the interpreter path differently (e.g. a 9p mount with
    noexec semantics); ``--library-path`` keeps every library lookup inside the bundle."""
    lib = f"{mount_point}/lib"
    return [
        f"{lib}/{LOADER_NAME}",
        "--library-path",
        lib,
        f"{mount_point}/bin/python3",
        "-I",
        "-m",
        "forkyard.envd",
        "--host",
        host,
        "--port",
        str(port),
    ]


def envd_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for envd (inherited by the processes it starts, under their own envs)."""
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        # envd's own interpreter ignores these (-I); user processes must not see the bundle.
    }
    env.update(extra or {})
    return env


# -- building -----------------------------------------------------------------------------------


def build_envd_bundle(settings: Settings) -> Path:
    """The bundle directory for the current envd source and dependencies (built if missing)."""
    py = host_python()
    digest = bundle_hash(py)
    root = bundle_root(settings)
    final = root / digest
    if (final / "manifest.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / ".lock"):
        if (final / "manifest.json").is_file():  # another process built it meanwhile
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{digest}-", dir=root))
        try:
            manifest = _assemble(tmp, py)
            manifest["hash"] = digest
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            tmp.chmod(0o755)
            if final.exists():  # a leftover without manifest: never completed
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _assemble(dest: Path, py: HostPython) -> dict[str, object]:
    (dest / "bin").mkdir(parents=True)
    (dest / "lib").mkdir()
    stdlib_dest = dest / STDLIB_REL
    site_rel = bundle_site_rel(py)
    site_dest = dest / site_rel
    _copy_stdlib(py.stdlib, stdlib_dest)
    site_entries = _envd_site_closure(py)
    site_dest.mkdir(parents=True, exist_ok=True)
    for entry in site_entries:
        _copy_entry(entry, site_dest / entry.name)
    forkyard_dest = site_dest / "forkyard"
    forkyard_dest.mkdir()
    for name in SHARED_MODULES:
        shutil.copy2(envd_source_dir().parent / name, forkyard_dest / name)
    shutil.copytree(envd_source_dir(), forkyard_dest / "envd", ignore=_ignore_pycache)
    shutil.copy2(py.executable, dest / "bin" / "python3")
    libs = _copy_shared_libraries(dest)
    _relocate_elves(dest)
    _write_launcher(dest)
    _write_sudo(dest, site_rel)
    _compile(dest, STDLIB_REL)
    if not site_dest.is_relative_to(stdlib_dest):
        _compile(dest, site_rel)
    return {
        "format": BUNDLE_FORMAT,
        "python": sys.version,
        "interpreter": str(py.executable),
        "site_packages": sorted(e.name for e in site_entries),
        "libraries": sorted(libs),
        "size_bytes": _tree_size(dest),
    }


def bundle_site_rel(py: HostPython) -> str:
    """Where, under the bundle, its interpreter's own ``site`` module looks for packages:
    ``lib/python3.X/site-packages`` for an upstream build; Debian's patched python (the image's,
    a fresh Debian 12's) never looks there outside a venv, only in ``lib/python3/dist-packages``."""
    script = f"import json, site; print(json.dumps(site.getsitepackages([{MOUNT_POINT!r}])))"
    argv = [str(py.executable), "-I", "-c", script]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        for path in json.loads(proc.stdout):
            relative = Path(path).relative_to(MOUNT_POINT)
            if relative.parts[0] == "lib":  # not local/lib: that one is for the sysadmin's packages
                return relative.as_posix()
    return f"{STDLIB_REL}/site-packages"


def _ignore_pycache(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"]


def _copy_stdlib(src: Path, dest: Path) -> None:
    def ignore(directory: str, names: list[str]) -> list[str]:
        here = Path(directory)
        dropped = [n for n in names if n in STDLIB_PRUNE_NESTED and (here / n).is_dir()]
        dropped += [n for n in names if n.endswith((".opt-1.pyc", ".opt-2.pyc", ".exe"))]
        if here == src:
            dropped += [n for n in names if n in STDLIB_PRUNE or n.startswith("config-")]
        if here.name == "lib-dynload":
            dropped += [n for n in names if DYNLOAD_PRUNE.match(n)]
        return dropped

    # copy2 keeps mtimes, so the stdlib's timestamp-based .pyc files stay valid.
    shutil.copytree(src, dest, ignore=ignore, symlinks=False)


_CLOSURE_SCRIPT = r"""
import importlib, json, pkgutil, sys
before = set(sys.modules)
import forkyard.envd
for info in pkgutil.walk_packages(forkyard.envd.__path__, "forkyard.envd."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
files = [getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n not in before]
files += [p for n, m in list(sys.modules.items()) if n not in before
          for p in (getattr(m, "__path__", None) or [])]
print(json.dumps(sorted({f for f in files if f})))
"""


def _envd_site_closure(py: HostPython) -> list[Path]:
    """Top-level site-packages entries (packages, modules, their .dist-info) envd imports.

    Found by importing every ``forkyard.envd`` module in a fresh isolated interpreter and
    recording the modules that appeared, so the list follows envd's code without upkeep."""
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _CLOSURE_SCRIPT, *RUNTIME_LAZY_MODULES],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BundleError(
            f"importing forkyard.envd failed, cannot compute its closure:\n{proc.stderr[-3000:]}"
        )
    imported = [Path(file) for file in json.loads(proc.stdout)]
    _check_project_imports(imported)
    entries: dict[str, Path] = {}
    for path in imported:
        for site in py.site_packages:
            if path.is_relative_to(site) and path != site:
                top = site / path.relative_to(site).parts[0]
                if top.name not in ("forkyard", "__pycache__") and not top.name.startswith("__editable__"):
                    entries[top.name] = top
    for dist in importlib.metadata.distributions():
        files = dist.files or []
        tops = {f.parts[0] for f in files}
        if tops & set(entries):
            info = Path(str(dist.locate_file(""))) / next(
                (f.parts[0] for f in files if f.parts[0].endswith(".dist-info")), ""
            )
            if info.name.endswith(".dist-info") and info.is_dir():
                entries[info.name] = info
    return sorted(entries.values())


def _check_project_imports(imported: list[Path]) -> None:
    """envd runs with only the bundled project modules: importing another one (forkyard.config,
    say) would work on the host and fail in every sandbox."""
    package = envd_source_dir().parent
    shipped = set(_bundled_sources())
    extra = sorted(
        str(path.relative_to(package))
        for path in imported
        if path.suffix == ".py" and path.is_relative_to(package) and path not in shipped
    )
    if extra:
        raise BundleError(f"envd imports project modules the bundle does not ship: {', '.join(extra)}")


def _copy_entry(src: Path, dest: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dest, ignore=_ignore_pycache)
    else:
        shutil.copy2(src, dest)


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _elves(dest: Path) -> list[Path]:
    return [p for p in dest.rglob("*") if p.is_file() and not p.is_symlink() and _is_elf(p)]


_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x[0-9a-f]+\)")
_LDD_LOADER = re.compile(r"^\s*(/\S*ld-linux[^\s]*)\s+\(0x[0-9a-f]+\)")


def _ldd(path: Path) -> dict[str, Path]:
    """soname -> host file of every library ``path`` needs (transitively), plus the loader."""
    proc = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    out = proc.stdout
    if "not a dynamic executable" in out + proc.stderr or "statically linked" in out:
        return {}
    found: dict[str, Path] = {}
    for line in out.splitlines():
        if "=> not found" in line:
            raise BundleError(f"{path} needs {line.split()[0]}, which is not installed on the host")
        if m := _LDD_LINE.match(line):
            found[m.group(1)] = Path(m.group(2))
        elif m := _LDD_LOADER.match(line):
            found[LOADER_NAME] = Path(m.group(1))
    return found


def _copy_shared_libraries(dest: Path) -> list[str]:
    libdir = dest / "lib"
    needed: dict[str, Path] = {}
    for elf in _elves(dest):
        needed.update(_ldd(elf))
    for name in DLOPENED_LIBS:
        for candidate in (Path("/lib/x86_64-linux-gnu") / name, Path("/usr/lib/x86_64-linux-gnu") / name):
            if candidate.exists():
                needed[name] = candidate
                break
    if LOADER_NAME not in needed:
        raise BundleError("could not find the dynamic loader of the host interpreter")
    for soname, host_file in needed.items():
        shutil.copy2(os.path.realpath(host_file), libdir / soname)
    return list(needed)


def _relocate_elves(dest: Path) -> None:
    """Strip debug symbols, then point the interpreter's PT_INTERP and every object's RUNPATH
    into the mounted bundle (RUNPATH is per object, so every object needs its own)."""
    lib = f"{MOUNT_POINT}/lib"
    python = dest / "bin" / "python3"
    elves = _elves(dest)
    strip = shutil.which("strip")
    if strip:  # debug symbols are most of libpython's 23 MB; envd never needs them
        for elf in elves:
            subprocess.run([strip, "--strip-debug", str(elf)], capture_output=True, check=False)
    _patchelf("--set-interpreter", f"{lib}/{LOADER_NAME}", "--set-rpath", lib, str(python))
    for elf in elves:
        if elf != python and not GLIBC_LIBS.match(elf.name):
            _patchelf("--set-rpath", lib, str(elf))


def _patchelf(*args: str) -> None:
    if shutil.which("patchelf") is None:
        raise BundleError("patchelf is not installed (apt-get install patchelf; scripts/bootstrap.sh)")
    proc = subprocess.run(["patchelf", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BundleError(f"patchelf {' '.join(args)} failed: {proc.stderr.strip()}")


def _write_launcher(dest: Path) -> None:
    """``/.forkyard/bin/envd``: a python script run through the bundle's own interpreter via the
    kernel's shebang handling, so it works in a root file system without any shell."""
    launcher = dest / "bin" / "envd"
    launcher.write_text(
        f"#!{MOUNT_POINT}/bin/python3 -I\n"
        '"""forkyard envd launcher (python -I -m forkyard.envd)."""\n'
        "import runpy\n"
        'runpy.run_module("forkyard.envd", run_name="__main__", alter_sys=True)\n'
    )
    launcher.chmod(0o755)


def _write_sudo(dest: Path, site_rel: str) -> None:
    """``/.forkyard/bin/sudo``: the sudo that asks envd (forkyard/envd/process/sudo.py); the gVisor runtime
    mounts it over the template's /usr/bin/sudo, whose set-uid bit gVisor ignores. ``-S``: no
    ``site`` (its .pth files cost a third of the start), the one directory it needs put on the path."""
    sudo = dest / "bin" / SUDO_SHIM
    sudo.write_text(
        f"#!{MOUNT_POINT}/bin/python3 -IS\n"
        '"""sudo through envd (forkyard.envd.process.sudo_client)."""\n'
        "import sys\n"
        f"sys.path.append({MOUNT_POINT + '/' + site_rel!r})\n"
        "from forkyard.envd.process.sudo_client import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    sudo.chmod(0o755)


def _compile(dest: Path, relative: str) -> None:
    """Byte-compile what has no valid .pyc yet (site-packages, envd); importing from source
    under gVisor's ptrace platform costs seconds at every sandbox start."""
    ok = compileall.compile_dir(str(dest / relative), quiet=2, workers=0, ddir=f"{MOUNT_POINT}/{relative}")
    if not ok:
        raise BundleError("byte-compiling the envd bundle failed")


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def remove_stale_bundles(settings: Settings, keep: set[str]) -> list[str]:
    """Delete bundles whose hash is not in ``keep`` (callers keep those of live sandboxes)."""
    root = bundle_root(settings)
    removed = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.is_dir() and entry.name not in keep and not entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed
