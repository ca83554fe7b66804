"""gVisor (runsc) runtime: one runsc sandbox per agentenv sandbox, envd as its init process.

Per sandbox, under ``{data_dir}/sandboxes/<sandbox_id>/``::

    upper/  work/   private writable layer of the host overlayfs (kept on disk: snapshots copy it)
    rootfs/         overlay mount: template rootfs (shared, read-only lower) + upper
    bundle/         OCI bundle (config.json) handed to runsc
    envd.log        envd's stdout/stderr;  runsc.log: runsc's own log

The network namespace ``ae-<sandbox_id>`` comes from :mod:`agentenv.runtime.network`; runsc's
``--network sandbox`` moves the netns's address into gVisor's netstack. The envd bundle is
bind-mounted read-only at ``/.agentenv``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx

from agentenv.config import Settings, get_settings
from agentenv.types import ENVD_PORT
from agentenv.runtime import network
from agentenv.runtime.base import CpuSampler, Runtime, RuntimeError_
from agentenv.types import LiveSnapshots, SandboxInstance, SandboxMetrics, SandboxSpec, SnapshotRef, TemplateImage
from agentenv.runtime.network import SandboxNetwork
from agentenv.storage.compat_libs import STATX_COMPAT
from agentenv.storage.envd_bundle import (
    MOUNT_POINT,
    build_envd_bundle,
    bundle_hash,
    envd_argv,
    envd_env,
    remove_stale_bundles,
)
from agentenv.storage.layers import LayerError, LayerStore, overlay_mount, overlay_unmount

log = logging.getLogger(__name__)

CONTAINER_PREFIX = "ae-"
CGROUP_PARENT = "agentenv"
CGROUP_V1_ROOT = Path("/sys/fs/cgroup")
ENVD_START_TIMEOUT = 60.0
#: The docker default capability set plus what envd needs to start processes as other users.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE", "CAP_SYS_PTRACE",
]


def container_id(sandbox_id: str) -> str:
    return CONTAINER_PREFIX + sandbox_id


@dataclass(frozen=True)
class SandboxPaths:
    root: Path

    @property
    def upper(self) -> Path:
        return self.root / "upper"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs"

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"

    @property
    def layers_file(self) -> Path:
        return self.root / "layers.json"

    @property
    def envd_log(self) -> Path:
        return self.root / "envd.log"

    @property
    def runsc_log(self) -> Path:
        return self.root / "runsc.log"


class GvisorRuntime(Runtime):
    name: ClassVar[str] = "gvisor"
    #: runsc platform chosen by ``auto``, per runsc binary (probing costs a runsc start).
    _platform_cache: ClassVar[dict[str, str]] = {}

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.runsc = self.settings.runsc_path
        self.runsc_root = self.settings.data_dir / "runsc"
        self._cpu = CpuSampler()
        #: Snapshot disk layers, shared read-only by snapshots and the sandboxes made from them.
        self.layers = LayerStore(self.settings.data_dir / "disk-layers")
        #: Held while a chain is mounted or layers are collected, so a collection never frees a
        #: layer a restore is about to stand on.
        self.layer_lock = asyncio.Lock()
        self._layer_bytes: dict[str, int] = {}

    # -- availability -------------------------------------------------------------------------

    @classmethod
    def probe(cls) -> str | None:
        runsc = get_settings().runsc_path
        if shutil.which(runsc) is None:
            return f"runsc binary {runsc!r} not found (apt-get install runsc)"
        try:
            proc = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{runsc} --version failed: {exc}"
        if proc.returncode != 0:
            return f"{runsc} --version failed: {(proc.stdout + proc.stderr).strip()[-500:]}"
        if os.geteuid() != 0:
            return "the gvisor runtime needs root (network namespaces, overlay mounts, cgroups)"
        return None

    def platform(self) -> str:
        """The runsc platform: the configured one, or for ``auto`` kvm when it can run
        hardware-virtualised guests here, else ptrace. gVisor's KVM platform needs VT-x/AMD-V:
        on a /dev/kvm without them (PVM-only hosts) runsc starts but hangs forever."""
        if self.settings.runsc_platform != "auto":
            return self.settings.runsc_platform
        cached = self._platform_cache.get(self.runsc)
        if cached:
            return cached
        from agentenv.runtime.registry import kvm_unusable_reason

        reason = kvm_unusable_reason()
        chosen = "ptrace"
        if reason is None and self._platform_works("kvm"):
            chosen = "kvm"
        elif reason is not None:
            log.info("runsc platform auto: not kvm (%s), using ptrace", reason)
        self._platform_cache[self.runsc] = chosen
        return chosen

    def _platform_works(self, platform: str) -> bool:
        root = self.settings.data_dir / "runsc-probe"
        root.mkdir(parents=True, exist_ok=True)
        cmd = [self.runsc, "--root", str(root), "--platform", platform, "--network", "none",
               "do", "/bin/true"]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            shutil.rmtree(root, ignore_errors=True)

    # -- building blocks (also used by the checkpoint/restore code) ---------------------------

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths(self.settings.data_dir / "sandboxes" / sandbox_id)

    def runsc_cmd(self, *args: str, log_file: Path | None = None) -> list[str]:
        cmd = [self.runsc, "--root", str(self.runsc_root)]
        if log_file is not None:
            cmd += ["--log", str(log_file)]
        return [*cmd, *args]

    @staticmethod
    def hide_proc_sys_net(cmd: list[str]) -> list[str]:
        """Wrap a runsc command that starts a sandbox (run, create, restore) for this runsc.

        runsc 2022-12 decides it was handed the root network namespace when
        ``/proc/sys/net/core/rmem_default`` exists, which on kernels >= 5.x it does in every
        namespace, so ``--network sandbox`` refuses all of them. In a private mount namespace
        with an empty, read-only /proc/sys/net the check sees no file; runsc reads nothing else
        there (gVisor's netstack has its own sysctls)."""
        script = 'mount -t tmpfs -o ro,size=4k agentenv-hide /proc/sys/net && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd]

    def runsc_run_flags(self) -> list[str]:
        """Global flags every ``runsc create/run/restore`` of a sandbox must share."""
        return ["--platform", self.platform(), "--network", "sandbox"]

    async def run_runsc(self, *args: str, check: bool = True, limit: float = 60.0) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *self.runsc_cmd(*args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError_(f"runsc {' '.join(args[:2])} timed out after {limit:.0f}s") from None
        text = out.decode(errors="replace").strip()
        if check and proc.returncode != 0:
            raise RuntimeError_(f"runsc {' '.join(args[:2])} failed: {text[-2000:]}")
        return proc.returncode or 0, text

    def mount_rootfs(self, sandbox_id: str, template: TemplateImage, layers: list[str] | None = None) -> Path:
        """Mount the sandbox's root view: its private upper over ``layers`` (snapshot disk layers
        from the layer store, newest first) over the template rootfs (shared, read-only).

        The chain is written to ``layers.json`` before the mount so that layer garbage
        collection (:meth:`collect_garbage`) sees every layer a sandbox stands on."""
        paths = self.paths(sandbox_id)
        paths.root.mkdir(parents=True, exist_ok=True)
        chain = list(layers or [])
        missing = [lid for lid in chain if not self.layers.exists(lid)]
        if missing:
            raise RuntimeError_(
                f"disk layers {', '.join(missing)} of sandbox {sandbox_id} are gone", code=410
            )
        write_json(paths.layers_file, chain)
        for d in (paths.upper, paths.work, paths.rootfs):
            d.mkdir(exist_ok=True)
        if not (template.rootfs / MOUNT_POINT.lstrip("/")).is_dir():
            (paths.upper / MOUNT_POINT.lstrip("/")).mkdir(exist_ok=True)
        if not os.path.ismount(paths.rootfs):
            lowers = [self.layers.path(lid) for lid in chain] + [template.rootfs]
            try:
                overlay_mount(paths.rootfs, lowers, paths.upper, paths.work)
            except LayerError as exc:
                raise RuntimeError_(
                    f"mounting the root file system of sandbox {sandbox_id} failed: {exc}"
                ) from None
        return paths.rootfs

    def sandbox_layers(self, sandbox_id: str) -> list[str]:
        """The snapshot layers the sandbox's root stands on (newest first)."""
        try:
            chain = json.loads(self.paths(sandbox_id).layers_file.read_text())
        except (OSError, ValueError):
            return []
        return [str(lid) for lid in chain]

    def unmount_rootfs(self, sandbox_id: str) -> None:
        overlay_unmount(self.paths(sandbox_id).rootfs)

    def oci_spec(
        self, spec: SandboxSpec, net: SandboxNetwork, rootfs: Path, envd_bundle: Path
    ) -> dict[str, Any]:
        """The OCI runtime config.json of a sandbox."""
        env = envd_env(spec.envs)
        if (envd_bundle / "lib" / STATX_COMPAT).is_file():
            # Inherited by every process envd starts: coreutils' statx works on this runsc.
            env["LD_PRELOAD"] = f"{MOUNT_POINT}/lib/{STATX_COMPAT}"
        if spec.envd_access_token:
            env["AGENTENV_ENVD_ACCESS_TOKEN"] = spec.envd_access_token
        tpl = spec.template
        caps = list(CAPABILITIES)
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": envd_argv(port=ENVD_PORT),
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": "/",
                "capabilities": {k: caps for k in ("bounding", "effective", "permitted", "inheritable")},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}],
                "noNewPrivileges": False,
            },
            "root": {"path": str(rootfs), "readonly": False},
            "hostname": "sandbox",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs",
                 "options": ["nosuid", "noexec", "nodev", "ro"]},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                 "options": ["nosuid", "nodev", "mode=1777"]},
                {"destination": MOUNT_POINT, "type": "bind", "source": str(envd_bundle),
                 "options": ["rbind", "ro"]},
            ],
            "linux": {
                "namespaces": [
                    {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                    {"type": "network", "path": net.netns_path},
                ],
                "cgroupsPath": f"/{CGROUP_PARENT}/{spec.sandbox_id}",
                "resources": {
                    "cpu": {"quota": tpl.vcpus * 100_000, "period": 100_000},
                    "memory": {"limit": tpl.memory_mb << 20},
                },
            },
        }

    def write_oci_bundle(self, sandbox_id: str, config: dict[str, Any]) -> Path:
        bundle = self.paths(sandbox_id).bundle
        bundle.mkdir(parents=True, exist_ok=True)
        tmp = bundle / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2))
        os.rename(tmp, bundle / "config.json")
        return bundle

    async def setup_network(self, spec: SandboxSpec) -> SandboxNetwork:
        return await network.setup_network(
            self.settings, spec.sandbox_id, allow_internet_access=spec.allow_internet_access
        )

    async def teardown_network(self, sandbox_id: str, net: SandboxNetwork | None = None) -> None:
        await network.teardown_network(self.settings, sandbox_id, net)

    async def wait_for_envd(self, sandbox_id: str, url: str, limit: float | None = None) -> None:
        """Return once envd answers ``GET /health``; fail early when the container died."""
        limit = ENVD_START_TIMEOUT if limit is None else limit
        deadline = time.monotonic() + limit
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"{url}/health")
                    if response.status_code < 300:
                        return
                status = await self.container_status(sandbox_id)
                if status not in ("created", "running"):
                    raise RuntimeError_(
                        f"sandbox {sandbox_id} stopped before envd started (runsc state: {status}); "
                        f"envd output: {self._tail(self.paths(sandbox_id).envd_log)}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError_(
                        f"envd of sandbox {sandbox_id} did not answer {url}/health within {limit:.0f}s; "
                        f"envd output: {self._tail(self.paths(sandbox_id).envd_log)}"
                    )
                await asyncio.sleep(0.05)

    @staticmethod
    def _tail(path: Path, size: int = 1500) -> str:
        try:
            return path.read_bytes()[-size:].decode(errors="replace").strip() or "(empty)"
        except OSError:
            return "(none)"

    async def container_status(self, sandbox_id: str) -> str:
        code, out = await self.run_runsc("state", container_id(sandbox_id), check=False)
        if code != 0:
            return "absent"
        try:
            return str(json.loads(out).get("status", "unknown"))
        except json.JSONDecodeError:
            return "unknown"

    def instance_for(self, spec: SandboxSpec, net: SandboxNetwork, envd_bundle: Path) -> SandboxInstance:
        return SandboxInstance(
            sandbox_id=spec.sandbox_id,
            runtime=self.name,
            envd_url=f"http://{net.sandbox_ip}:{ENVD_PORT}",
            address=net.sandbox_ip,
            state={
                "container_id": container_id(spec.sandbox_id),
                "network": net.to_state(),
                "envd_bundle": str(envd_bundle),
                "template_id": spec.template.template_id,
                "template_rootfs": str(spec.template.rootfs),
                "vcpus": spec.template.vcpus,
                "memory_mb": spec.template.memory_mb,
                "disk_mb": spec.template.disk_mb,
                "platform": self.platform(),
            },
        )

    # -- Runtime interface --------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        envd_bundle = await asyncio.to_thread(build_envd_bundle, self.settings)
        paths = self.paths(spec.sandbox_id)
        if paths.root.exists():
            raise RuntimeError_(f"sandbox {spec.sandbox_id} already exists on this node", code=409)
        net: SandboxNetwork | None = None
        try:
            net = await self.setup_network(spec)
            rootfs = await asyncio.to_thread(self.mount_rootfs, spec.sandbox_id, spec.template)
            self.write_oci_bundle(spec.sandbox_id, self.oci_spec(spec, net, rootfs, envd_bundle))
            instance = self.instance_for(spec, net, envd_bundle)
            await self.start_container(spec.sandbox_id)
            await self.wait_for_envd(spec.sandbox_id, instance.envd_url)
        except BaseException:
            await self._destroy(spec.sandbox_id, net)
            raise
        return instance

    async def start_container(self, sandbox_id: str, *extra: str) -> None:
        """``runsc run --detach``: returns once the container runs, its output going to envd.log."""
        paths = self.paths(sandbox_id)
        with paths.envd_log.open("ab") as out:
            cmd = self.runsc_cmd(*self.runsc_run_flags(), "run", "--detach", "--bundle", str(paths.bundle),
                                 *extra, container_id(sandbox_id), log_file=paths.runsc_log)
            proc = await asyncio.create_subprocess_exec(
                *self.hide_proc_sys_net(cmd),
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            )
            code = await asyncio.wait_for(proc.wait(), 120)
        if code != 0:
            raise RuntimeError_(
                f"runsc run of sandbox {sandbox_id} failed (exit {code}): {self._tail(paths.runsc_log)}"
            )

    async def kill(self, instance: SandboxInstance) -> None:
        net_state = instance.state.get("network")
        net = SandboxNetwork.from_state(net_state) if net_state else None
        await self._destroy(instance.sandbox_id, net)

    async def _destroy(self, sandbox_id: str, net: SandboxNetwork | None) -> None:
        """Remove everything of ``sandbox_id``; every step tolerates an already-missing part."""
        cid = container_id(sandbox_id)
        # SIGKILL the sandbox and gofer ourselves (nothing inside deserves a graceful stop;
        # ``runsc kill`` would cost another runsc start), then drop runsc's record of the
        # container, two files. ``runsc delete --force`` did the same in 1.5 s, most of it
        # polling processes that are already gone; the cgroups are removed below.
        await self._reap_processes(cid, self.paths(sandbox_id).root)
        self.forget_container(cid)
        self._cpu.forget(sandbox_id)
        await asyncio.to_thread(self.unmount_rootfs, sandbox_id)
        await self.teardown_network(sandbox_id, net)
        remove_cgroups(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, self.paths(sandbox_id).root, True)

    def forget_container(self, cid: str) -> None:
        """Remove runsc's record (state and lock file) of a container whose processes are gone."""
        for suffix in (".state", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.runsc_root / f"{cid}_sandbox:{cid}{suffix}")

    async def _reap_processes(self, cid: str, sandbox_dir: Path | None = None, limit: float = 10.0) -> None:
        """SIGKILL the runsc sandbox/gofer processes of ``cid`` and wait until they are gone."""
        deadline = time.monotonic() + limit
        while pids := runsc_processes(cid, self.runsc_root, sandbox_dir):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            if time.monotonic() > deadline:
                raise RuntimeError_(f"runsc processes {pids} of {cid} do not exit")
            await asyncio.sleep(0.05)

    async def is_alive(self, instance: SandboxInstance) -> bool:
        return await self.container_status(instance.sandbox_id) == "running"

    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        sid = instance.sandbox_id
        vcpus = int(instance.state.get("vcpus", 1))
        mem_total = int(instance.state.get("memory_mb", 512)) << 20
        mem_used = _read_int(CGROUP_V1_ROOT / "memory" / CGROUP_PARENT / sid / "memory.usage_in_bytes")
        cpu_usage = CGROUP_V1_ROOT / "cpuacct" / CGROUP_PARENT / sid / "cpuacct.usage"
        cpu_pct = self._cpu.percent(sid, _read_int(cpu_usage) / 1e9, vcpus)
        if cpu_pct is None:  # first sample: measure over a short window
            await asyncio.sleep(0.1)
            cpu_pct = self._cpu.percent(sid, _read_int(cpu_usage) / 1e9, vcpus) or 0.0
        disk_used = await asyncio.to_thread(self._disk_used, sid)
        return SandboxMetrics(
            cpu_count=vcpus, cpu_used_pct=round(cpu_pct, 2), mem_used=mem_used, mem_total=mem_total,
            disk_used=disk_used, disk_total=int(instance.state.get("disk_mb", 4096)) << 20,
        )

    def _disk_used(self, sandbox_id: str) -> int:
        """What the sandbox wrote: its upper plus the snapshot layers under it (each layer is
        sealed, so its size is measured once)."""
        used = disk_usage(self.paths(sandbox_id).upper)
        for layer_id in self.sandbox_layers(sandbox_id):
            if layer_id not in self._layer_bytes and self.layers.exists(layer_id):
                self._layer_bytes[layer_id] = self.layers.disk_usage(layer_id)
            used += self._layer_bytes.get(layer_id, 0)
        return used

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        found: set[str] = set()
        code, out = await self.run_runsc("list", "-quiet", check=False)
        if code == 0:
            found |= {c[len(CONTAINER_PREFIX):] for c in out.split() if c.startswith(CONTAINER_PREFIX)}
        sandboxes = self.settings.data_dir / "sandboxes"
        if sandboxes.is_dir():
            found |= {d.name for d in sandboxes.iterdir() if d.is_dir()}
        found |= set(network.list_orphans(self.settings, keep))
        orphans = sorted(found - keep)
        for sandbox_id in orphans:
            await self._destroy(sandbox_id, None)
        await asyncio.to_thread(self._remove_unused_bundles)
        return orphans

    def _remove_unused_bundles(self) -> None:
        """Delete envd bundles that neither the current envd nor a remaining sandbox uses
        (every envd edit or dependency upgrade leaves one behind)."""
        in_use = {bundle_hash()}
        sandboxes = self.settings.data_dir / "sandboxes"
        for config in sandboxes.glob("*/bundle/config.json") if sandboxes.is_dir() else []:
            with contextlib.suppress(OSError, ValueError, KeyError):
                mounts = json.loads(config.read_text())["mounts"]
                in_use |= {Path(m["source"]).name for m in mounts if m["destination"] == MOUNT_POINT}
        remove_stale_bundles(self.settings, in_use)

    async def collect_garbage(self, live_snapshots: LiveSnapshots) -> list[str]:
        checkpoint = importlib.import_module("agentenv.runtime.gvisor.checkpoint")
        in_use: set[str] = set()
        async with self.layer_lock:
            # Listed under the lock: a snapshot committed while this collection waited for it
            # (and whose sandbox is gone since) must count.
            for ref in await live_snapshots():
                in_use |= set(checkpoint.snapshot_layers(ref.path))
            sandboxes = self.settings.data_dir / "sandboxes"
            for sandbox_dir in sandboxes.iterdir() if sandboxes.is_dir() else []:
                in_use |= set(self.sandbox_layers(sandbox_dir.name))
            removed: list[str] = await asyncio.to_thread(self.layers.gc, in_use)
        for layer_id in removed:
            self._layer_bytes.pop(layer_id, None)
        if removed:
            log.info("freed disk layers %s", ", ".join(removed))
        return removed

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        checkpoint = importlib.import_module("agentenv.runtime.gvisor.checkpoint")
        await checkpoint.snapshot(self, instance, dest, stop)

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        checkpoint = importlib.import_module("agentenv.runtime.gvisor.checkpoint")
        restored: SandboxInstance = await checkpoint.restore(self, spec, source)
        return restored


def runsc_processes(cid: str, runsc_root: Path, sandbox_dir: Path | None = None) -> list[int]:
    """PIDs of runsc processes (sandbox, gofer, ...) serving container ``cid`` under
    ``runsc_root``: the sandbox process names the container id, the gofer only its bundle
    (inside ``sandbox_dir``)."""
    pids = []
    markers = [cid] + ([f"{sandbox_dir}/"] if sandbox_dir else [])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in args]
        if not text or not text[0].startswith("runsc"):
            continue
        in_root = f"--root={runsc_root}" in text or str(runsc_root) in text
        if in_root and any(m in a for a in text for m in markers):
            pids.append(int(entry.name))
    return pids


def remove_cgroups(sandbox_id: str) -> None:
    """rmdir the sandbox's cgroup in every v1 hierarchy (and the v2 tree), deepest first."""
    for hierarchy in CGROUP_V1_ROOT.iterdir() if CGROUP_V1_ROOT.is_dir() else []:
        group = hierarchy / CGROUP_PARENT / sandbox_id
        if group.is_dir():
            for sub in sorted(group.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if sub.is_dir():
                    with contextlib.suppress(OSError):
                        sub.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()


def cgroup_exists(sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup directories that still exist (for tests and diagnostics)."""
    if not CGROUP_V1_ROOT.is_dir():
        return []
    return [h / CGROUP_PARENT / sandbox_id for h in CGROUP_V1_ROOT.iterdir()
            if (h / CGROUP_PARENT / sandbox_id).is_dir()]


def write_json(path: Path, value: Any) -> None:
    """Replace ``path`` atomically with ``value`` as JSON."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def disk_usage(root: Path) -> int:
    """Bytes allocated by the files under ``root`` (not following symlinks)."""
    total = 0
    stack = [root]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                for entry in it:
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        total += st.st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
        except OSError:
            continue
    return total
