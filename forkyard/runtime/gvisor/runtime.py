"""gVisor (runsc) runtime: one runsc sandbox per forkyard sandbox, envd as its init process.

Each sandbox has a scratch directory (:mod:`~forkyard.runtime.gvisor.paths`), a root overlay
(:mod:`~forkyard.runtime.gvisor.disk`), the network namespace ``ae-<sandbox_id>`` from
:mod:`forkyard.runtime.network` (runsc's ``--network sandbox`` moves the netns's address into
gVisor's netstack) and the cgroups of :mod:`~forkyard.runtime.gvisor.cgroups`. The envd bundle is
bind-mounted read-only at ``/.forkyard``. Snapshots and restores are put together here from the
steps in :mod:`~forkyard.runtime.gvisor.checkpoint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from forkyard.config import Settings
from forkyard.errors import Conflict, Failed, Gone
from forkyard.runtime import network
from forkyard.runtime.base import Capability, CpuSampler, Runtime, envd_healthy, log_tail
from forkyard.runtime.gvisor import cgroups, checkpoint, freezer, oom, watch
from forkyard.runtime.gvisor.checkpoint import MEMORY_DIR, elapsed_ms
from forkyard.runtime.gvisor.disk import RootDisks
from forkyard.runtime.gvisor.paths import CONTAINER_PREFIX, SandboxPaths, sandboxes_dir
from forkyard.runtime.gvisor.runsc import Runsc
from forkyard.runtime.gvisor.state import GvisorState
from forkyard.runtime.network import SandboxNetwork
from forkyard.storage.atomic import write_json_atomic
from forkyard.storage.envd_bundle import (
    MOUNT_POINT,
    SUDO_SHIM,
    build_envd_bundle,
    bundle_hash,
    envd_argv,
    envd_env,
    remove_stale_bundles,
)
from forkyard.types import (
    ENVD_ACCESS_TOKEN_ENV,
    ENVD_DEFAULT_WORKDIR_ENV,
    ENVD_ENVS_FILE_ENV,
    ENVD_FILES_AS_USER_ENV,
    ENVD_PORT,
    SANDBOX_ENVS_FILE,
    LiveSnapshots,
    RuntimeName,
    SandboxInstance,
    SandboxMetrics,
    SandboxSpec,
    SnapshotRef,
    VolumeMount,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a new sandbox's envd gets to answer ``/health``.
ENVD_START_TIMEOUT = 60.0
#: Seconds a restored sandbox's envd gets (its process is already running).
ENVD_RESTORE_TIMEOUT = 30.0
#: Seconds a kill keeps retrying to remove the sandbox's cgroups while the kernel releases its
#: killed tasks.
CGROUP_SETTLE_SECONDS = 1.0
#: Processes (per user inside) a sandbox may have: RLIMIT_NPROC, which gVisor's kernel enforces
#: (a fork beyond it fails with EAGAIN inside, as on Linux).
NPROC_LIMIT = 2048
#: The host cgroup's pids.max, a backstop for the node: every address space inside is a host
#: stub process and every running task may hold a sentry thread. Reaching it makes the sentry
#: panic (measured: "trying to use inactive address space"), so it sits well above what
#: NPROC_LIMIT lets a sandbox reach; the death is then noticed like any other.
HOST_PIDS_LIMIT = 16384
#: The docker default capability set plus what envd needs to start processes as other users.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
    "CAP_SYS_PTRACE",
]


class GvisorRuntime(Runtime):
    name: ClassVar[RuntimeName] = "gvisor"
    capabilities = frozenset(
        {
            Capability.FREEZE,
            Capability.FILESYSTEM_PAUSE,
            Capability.EXPORT_ROOT,
            Capability.ROOT_LAYERS,
            Capability.VOLUMES,
        }
    )

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.runsc = Runsc(
            settings.gvisor, root=settings.data_dir / "runsc", probe_dir=settings.data_dir / "runsc-probe"
        )
        self.disks = RootDisks(settings.data_dir)
        self._cpu = CpuSampler()
        #: The OOM guard of each sandbox this process started or re-attached.
        self._oom_guards: dict[str, oom.Guard] = {}

    def _guard_memory(self, paths: SandboxPaths) -> None:
        """(Re)arm the sandbox's OOM guard; called right after every runsc start."""
        self._unguard_memory(paths.sandbox_id)
        guard = oom.Guard.arm(self.runsc, paths, paths.envd_log)
        if guard is not None:
            self._oom_guards[paths.sandbox_id] = guard

    def _unguard_memory(self, sandbox_id: str) -> None:
        guard = self._oom_guards.pop(sandbox_id, None)
        if guard is not None:
            guard.close()

    def platform(self) -> str:
        return self.runsc.platform()

    def probe(self) -> str | None:
        runsc = self.runsc.binary
        if shutil.which(runsc) is None:
            return f"runsc binary {runsc!r} not found (scripts/bootstrap.sh installs it)"
        unsupported = self.runsc.unsupported_reason()
        if unsupported is not None:
            return unsupported
        if os.geteuid() != 0:
            return "the gvisor runtime needs root (network namespaces, overlay mounts, cgroups)"
        self.runsc.platform()  # ``auto`` measures here, once, rather than in the first create
        return None

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths.of(self.settings.data_dir, sandbox_id)

    # -- create and kill ------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        paths = self.paths(spec.sandbox_id)
        if paths.root.exists():
            raise Conflict(f"sandbox {spec.sandbox_id} already exists on this node")
        envd_bundle = await asyncio.to_thread(build_envd_bundle, self.settings)
        net: SandboxNetwork | None = None
        try:
            net = await self._setup_network(spec)
            rootfs = await asyncio.to_thread(
                self.disks.mount, paths, spec.template.rootfs, [], spec.template.disk_mb
            )
            sudo_shim = self._has_sudo(rootfs)
            self._write_bundle(spec, net, rootfs, envd_bundle, sudo_shim)
            instance = self._instance(spec, net, envd_bundle, sudo_shim)
            await self.runsc.start(paths)
            self._guard_memory(paths)
            await self._wait_for_envd(paths, instance.envd_url, ENVD_START_TIMEOUT)
        except BaseException:
            await self._destroy(paths, net)
            raise
        return instance

    async def freeze(self, instance: SandboxInstance) -> None:
        await freezer.freeze(instance.sandbox_id)

    async def thaw(self, instance: SandboxInstance) -> None:
        await freezer.thaw(instance.sandbox_id)

    async def kill(self, instance: SandboxInstance) -> None:
        # A frozen sandbox's tasks take no SIGKILL until thawed (cgroup v1).
        await freezer.thaw(instance.sandbox_id)
        await self._destroy(self.paths(instance.sandbox_id), instance.network)

    async def claimed(self, instance: SandboxInstance) -> None:
        await asyncio.to_thread(cgroups.set_cpu_shares, instance.sandbox_id, cgroups.LIVE_CPU_SHARES)

    async def halt(self, instance: SandboxInstance) -> None:
        await freezer.thaw(instance.sandbox_id)
        await self.runsc.stop(self.paths(instance.sandbox_id))

    async def _destroy(self, paths: SandboxPaths, net: SandboxNetwork | None) -> None:
        """Remove everything of the sandbox; every step tolerates an already-missing part."""
        await self._stop_sandbox(paths, net)
        await asyncio.to_thread(shutil.rmtree, paths.root, True)

    # -- the filesystem pause tier: stop, keep the disk, boot again over it ----------------------

    async def stop_keep_disk(self, instance: SandboxInstance) -> SandboxInstance:
        await freezer.thaw(instance.sandbox_id)
        paths = self.paths(instance.sandbox_id)
        await self._stop_sandbox(paths, instance.network)
        # The network's slot goes back to the pool: a later kill must not tear down whoever has it.
        return dataclasses.replace(instance, network=None)

    async def boot_kept_disk(self, spec: SandboxSpec, kept: SandboxInstance) -> SandboxInstance:
        paths = self.paths(spec.sandbox_id)
        if not paths.layers_file.exists():
            raise Gone(f"the kept disk of sandbox {spec.sandbox_id} is gone")
        envd_bundle = await asyncio.to_thread(build_envd_bundle, self.settings)
        net: SandboxNetwork | None = None
        try:
            net = await self._setup_network(spec)
            chain = self.disks.chain(paths)
            rootfs = await asyncio.to_thread(
                self.disks.mount, paths, spec.template.rootfs, chain, spec.template.disk_mb
            )
            sudo_shim = self._has_sudo(rootfs)
            self._write_bundle(spec, net, rootfs, envd_bundle, sudo_shim)
            instance = self._instance(spec, net, envd_bundle, sudo_shim)
            await self.runsc.start(paths)
            self._guard_memory(paths)
            await self._wait_for_envd(paths, instance.envd_url, ENVD_START_TIMEOUT)
        except BaseException:
            await self._stop_sandbox(paths, net)  # the disk stays: the sandbox is still paused
            raise
        return instance

    async def _stop_sandbox(self, paths: SandboxPaths, net: SandboxNetwork | None) -> None:
        """Everything of :meth:`_destroy` but the sandbox's files (its disk image, upper, layers).
        Every step tolerates an already-missing part."""
        # SIGKILL, not a graceful stop: nothing inside deserves one, and ``runsc kill`` would
        # cost another runsc start.
        self._unguard_memory(paths.sandbox_id)
        await self.runsc.stop(paths)
        self._cpu.forget(paths.sandbox_id)
        await asyncio.to_thread(self.disks.unmount, paths)
        await asyncio.to_thread(self.disks.release_disk, paths)
        await network.teardown_network(self.settings, paths.sandbox_id, net)
        await asyncio.to_thread(cgroups.remove, paths.sandbox_id, settle=CGROUP_SETTLE_SECONDS)

    async def export_root(self, instance: SandboxInstance, dest: Path) -> None:
        """The host overlay is the root the sandbox sees (``--overlay2=none``): copy its merged
        view. Only the root mount: /proc, /dev, /tmp and the envd bundle live inside the sentry."""
        merged = self.paths(instance.sandbox_id).rootfs
        proc = await asyncio.create_subprocess_exec(
            "cp",
            "-a",
            "--one-file-system",
            f"{merged}/.",
            str(dest),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise Failed(f"copying the root of {instance.sandbox_id} failed: {err.decode()[-800:]}")

    def root_layers(self, instance: SandboxInstance) -> list[Path]:
        paths = self.paths(instance.sandbox_id)
        return [paths.upper, *(self.disks.layers.path(lid) for lid in self.disks.chain(paths))]

    async def _setup_network(self, spec: SandboxSpec) -> SandboxNetwork:
        return await network.setup_network(
            self.settings,
            spec.sandbox_id,
            allow_internet_access=spec.allow_internet_access,
            egress=spec.egress,
        )

    # -- what a sandbox is made of --------------------------------------------------------------

    @staticmethod
    def _has_sudo(rootfs: Path) -> bool:
        """gVisor ignores set-uid bits ("no new privileges"): a template's sudo gives way to the
        bundle's, which asks envd (forkyard/envd/process/sudo.py). Decided at boot and kept in the
        snapshot's meta: a restore must have the mounts its checkpoint had."""
        return os.path.lexists(rootfs / "usr/bin/sudo")

    @staticmethod
    def _sudo_mounts(envd_bundle: Path, sudo_shim: bool) -> list[dict[str, Any]]:
        if not sudo_shim:
            return []
        shim = str(envd_bundle / "bin" / SUDO_SHIM)
        return [{"destination": "/usr/bin/sudo", "type": "bind", "source": shim, "options": ["bind", "ro"]}]

    @staticmethod
    def _volume_mounts(volumes: tuple[VolumeMount, ...]) -> list[dict[str, Any]]:
        """Each volume's directory bound read-write: its files go through the gofer as any other
        host file (shared with every sandbox that binds it; runsc's default ``shared`` file access
        for mounts other than the root revalidates what another sandbox changed)."""
        return [
            {"destination": v.path, "type": "bind", "source": v.source, "options": ["rbind", "rw"]}
            for v in volumes
        ]

    def oci_spec(
        self,
        spec: SandboxSpec,
        net: SandboxNetwork,
        rootfs: Path,
        envd_bundle: Path,
        sudo_shim: bool = False,
    ) -> dict[str, Any]:
        """The OCI runtime config.json of a sandbox."""
        env = envd_env(spec.envs)
        if spec.envd_access_token:
            env[ENVD_ACCESS_TOKEN_ENV] = spec.envd_access_token
        tpl = spec.template
        if tpl.workdir:
            env[ENVD_DEFAULT_WORKDIR_ENV] = tpl.workdir
        if self.settings.envd_files_as_user:
            env[ENVD_FILES_AS_USER_ENV] = "1"
        env[ENVD_ENVS_FILE_ENV] = SANDBOX_ENVS_FILE
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
                "rlimits": [
                    {"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536},
                    {"type": "RLIMIT_NPROC", "hard": NPROC_LIMIT, "soft": NPROC_LIMIT},
                ],
                "noNewPrivileges": False,
            },
            "root": {"path": str(rootfs), "readonly": False},
            "hostname": "sandbox",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {
                    "destination": "/sys",
                    "type": "sysfs",
                    "source": "sysfs",
                    "options": ["nosuid", "noexec", "nodev", "ro"],
                },
                {
                    # Its pages are the sentry's own memory: unbounded, filling /tmp would get the
                    # sentry (the whole sandbox) OOM-killed. Half the memory, as Linux sizes tmpfs.
                    "destination": "/tmp",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777", f"size={max(tpl.memory_mb // 2, 16)}m"],
                },
                {
                    "destination": MOUNT_POINT,
                    "type": "bind",
                    "source": str(envd_bundle),
                    "options": ["rbind", "ro"],
                },
                *self._sudo_mounts(envd_bundle, sudo_shim),
                *self._volume_mounts(spec.volumes),
            ],
            "linux": {
                "namespaces": [
                    {"type": "pid"},
                    {"type": "ipc"},
                    {"type": "uts"},
                    {"type": "mount"},
                    {"type": "network", "path": net.netns_path},
                ],
                "cgroupsPath": cgroups.cgroups_path(spec.sandbox_id),
                "resources": {
                    # cpu.cfs_quota_us: the template's vCPUs (the sentry reports that many CPUs,
                    # --cpu-num-from-quota); memory: the sentry reports this much as MemTotal.
                    "cpu": {
                        "quota": tpl.vcpus * 100_000,
                        "period": 100_000,
                        "shares": cgroups.AHEAD_OF_DEMAND_CPU_SHARES
                        if spec.ahead_of_demand
                        else cgroups.LIVE_CPU_SHARES,
                    },
                    "memory": {"limit": tpl.memory_mb << 20},
                    "pids": {"limit": HOST_PIDS_LIMIT},
                },
            },
        }

    def _write_bundle(
        self, spec: SandboxSpec, net: SandboxNetwork, rootfs: Path, envd_bundle: Path, sudo_shim: bool
    ) -> None:
        bundle = self.paths(spec.sandbox_id).bundle
        bundle.mkdir(parents=True, exist_ok=True)
        config = self.oci_spec(spec, net, rootfs, envd_bundle, sudo_shim)
        write_json_atomic(bundle / "config.json", config, indent=2)

    def _instance(
        self, spec: SandboxSpec, net: SandboxNetwork, envd_bundle: Path, sudo_shim: bool
    ) -> SandboxInstance:
        return SandboxInstance(
            sandbox_id=spec.sandbox_id,
            runtime=self.name,
            envd_url=f"http://{net.sandbox_ip}:{ENVD_PORT}",
            address=net.sandbox_ip,
            template_rootfs=str(spec.template.rootfs),
            network=net,
            volume_mounts=spec.volumes,
            state=GvisorState(
                container_id=self.paths(spec.sandbox_id).container_id,
                envd_bundle=str(envd_bundle),
                template_id=spec.template.template_id,
                vcpus=spec.template.vcpus,
                memory_mb=spec.template.memory_mb,
                disk_mb=spec.template.disk_mb,
                platform=self.runsc.platform(),
                sudo_shim=sudo_shim,
            ).to_json(),
        )

    async def _wait_for_envd(self, paths: SandboxPaths, url: str, limit: float) -> None:
        """Return once envd answers ``GET /health``; fail early when the container died."""
        # A restored envd answers at once, a booting one in about a second: poll often at first,
        # over a plain socket (an httpx client costs ~40 ms to make, most of a restore's wait).
        # A sentry that is gone fails it at once (its pid file, no process start); whether the
        # container still runs is asked of runsc (a CLI start, ~20 ms) only after the first
        # 100 ms, then at most every 250 ms: a restored envd's first poll answers in 12-24 ms
        # here, and one that misses it answers on the next, without a CLI start in between.
        started = time.monotonic()
        deadline = started + limit
        interval, next_status = 0.005, started + 0.1
        while not await envd_healthy(url):
            named = watch.read_pid(paths.sentry_pid_file)
            if named is not None and watch.sentry_pid(paths.container_id, named) is None:
                raise Failed(
                    f"sandbox {paths.sandbox_id} stopped before envd started (its runsc sandbox "
                    f"process is gone); envd output: {log_tail(paths.envd_log)}"
                )
            if time.monotonic() >= next_status:
                status = await self.runsc.status(paths.container_id)
                if status not in ("created", "running"):
                    raise Failed(
                        f"sandbox {paths.sandbox_id} stopped before envd started (runsc state: {status}); "
                        f"envd output: {log_tail(paths.envd_log)}"
                    )
                next_status = time.monotonic() + 0.25
            if time.monotonic() > deadline:
                raise Failed(
                    f"envd of sandbox {paths.sandbox_id} did not answer {url}/health "
                    f"within {limit:.0f}s; envd output: {log_tail(paths.envd_log)}"
                )
            await asyncio.sleep(interval)
            interval = min(interval * 2, 0.05)

    # -- observing ------------------------------------------------------------------------------

    async def wait_exit(self, instance: SandboxInstance) -> str | None:
        """Wait on a pidfd of the sandbox's runsc sandbox process (see :mod:`~.watch`); while
        it runs, its OOM kills stay inside it (:class:`oom.Guard`, armed at every start)."""
        paths = self.paths(instance.sandbox_id)
        oom_kills = cgroups.oom_kills(instance.sandbox_id)
        pid = _started_sentry(paths)
        if pid is None and freezer.is_frozen(instance.sandbox_id):  # runsc state would hang on it
            pid = await asyncio.to_thread(watch.find_sentry, paths.container_id)
        elif pid is None:  # started before runsc wrote pid files for us
            pid = watch.sentry_pid(paths.container_id, await self.runsc.sandbox_pid(paths.container_id))
        if pid is None:
            if await self.is_alive(instance):
                return None  # runsc says running but names no process: cannot watch
            return "its runsc sandbox process is gone"
        if instance.sandbox_id not in self._oom_guards:  # re-attached after a server restart
            self._guard_memory(paths)
        await watch.wait_pid(pid)
        return watch.death_reason(instance.sandbox_id, pid, oom_kills, log_tail(paths.envd_log))

    async def is_alive(self, instance: SandboxInstance) -> bool:
        if freezer.is_frozen(instance.sandbox_id):  # runsc state would hang on a frozen sentry
            return freezer.has_tasks(instance.sandbox_id)
        return await self.runsc.status(self.paths(instance.sandbox_id).container_id) == "running"

    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        sid, state = instance.sandbox_id, GvisorState.of(instance)
        vcpus = state.vcpus
        cpu_pct = self._cpu.percent(sid, cgroups.cpu_seconds(sid), vcpus)
        if cpu_pct is None:  # first sample: measure over a short window
            await asyncio.sleep(0.1)
            cpu_pct = self._cpu.percent(sid, cgroups.cpu_seconds(sid), vcpus) or 0.0
        disk_used = await asyncio.to_thread(self.disks.used_bytes, self.paths(sid))
        return SandboxMetrics(
            cpu_count=vcpus,
            cpu_used_pct=round(cpu_pct, 2),
            mem_used=cgroups.memory_used(sid),
            mem_total=state.memory_mb << 20,
            disk_used=disk_used,
            disk_total=state.disk_mb << 20,
        )

    # -- crash recovery and garbage -------------------------------------------------------------

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        found = {
            cid.removeprefix(CONTAINER_PREFIX)
            for cid in await self.runsc.containers()
            if cid.startswith(CONTAINER_PREFIX)
        }
        found |= set(self._sandbox_dirs())
        found |= set(network.list_orphans(self.settings, keep))
        orphans = sorted(found - keep)
        for sandbox_id in orphans:
            await self._destroy(self.paths(sandbox_id), None)
        await asyncio.to_thread(self._remove_empty_cgroups, keep)
        await asyncio.to_thread(self._remove_unused_bundles)
        return orphans

    @staticmethod
    def _remove_empty_cgroups(keep: set[str]) -> None:
        """rmdir the empty ``forkyard/<id>`` cgroups no record names. Only rmdir: the cgroup
        tree is the host's, shared with other servers' sandboxes, and rmdir refuses a cgroup
        that still has tasks (a paused-to-disk sandbox's empty one is made again by its restore)."""
        for sandbox_id in cgroups.sandbox_ids() - keep:
            cgroups.remove(sandbox_id)

    def _sandbox_dirs(self) -> list[str]:
        """Ids of the sandboxes that have a scratch directory on this node."""
        root = sandboxes_dir(self.settings.data_dir)
        return [d.name for d in root.iterdir() if d.is_dir()] if root.is_dir() else []

    def _remove_unused_bundles(self) -> None:
        """Delete envd bundles that neither the current envd nor a remaining sandbox uses
        (every envd edit or dependency upgrade leaves one behind)."""
        in_use = {bundle_hash()}
        for sandbox_id in self._sandbox_dirs():
            with contextlib.suppress(OSError, ValueError, KeyError):
                mounts = json.loads((self.paths(sandbox_id).bundle / "config.json").read_text())["mounts"]
                in_use |= {Path(m["source"]).name for m in mounts if m["destination"] == MOUNT_POINT}
        remove_stale_bundles(self.settings, in_use)

    async def collect_garbage(self, live_snapshots: LiveSnapshots) -> list[str]:
        in_use: set[str] = set()
        async with self.disks.lock:
            # Listed under the lock: a snapshot committed while this collection waited for it
            # (and whose sandbox is gone since) must count.
            for ref in await live_snapshots():
                in_use |= set(checkpoint.snapshot_layers(ref.path))
            for sandbox_id in self._sandbox_dirs():
                in_use |= self.disks.in_use(self.paths(sandbox_id))
            removed = await asyncio.to_thread(self.disks.collect, in_use)
        if removed:
            log.info("freed disk layers %s", ", ".join(removed))
        return removed

    # -- snapshots --------------------------------------------------------------------------------

    async def snapshot_keeps_running(self, instance: SandboxInstance) -> bool:
        paths = self.paths(instance.sandbox_id)
        return await asyncio.to_thread(checkpoint.can_snapshot_running, self.disks, paths)

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Checkpoint into ``dest.path``: memory image, meta, and the disk as a chain of shared
        layers (the upper sealed into a new one, see :func:`checkpoint.seal_upper`).

        ``stop``: leave the sandbox stopped, its network (slot, netns) and scratch directory kept
        for a later resume; otherwise it keeps running: paused only for the checkpoint and a copy
        of its upper when that is small, else remounted and restored in place."""
        paths = self.paths(instance.sandbox_id)
        image = dest.path / MEMORY_DIR
        dest.path.mkdir(parents=True, exist_ok=True)
        timings: dict[str, float] = {}
        if not stop and await asyncio.to_thread(checkpoint.can_snapshot_running, self.disks, paths):
            await self._snapshot_running(instance, paths, dest)
            return
        t = time.monotonic()
        await checkpoint.checkpoint_container(self.runsc, paths, instance.address, image)
        timings["checkpoint_ms"] = elapsed_ms(t)
        t = time.monotonic()
        chain = await checkpoint.seal_upper(self.disks, paths)
        checkpoint.write_meta(dest.path, instance, chain)
        timings["disk_seal_ms"] = elapsed_ms(t)
        if not stop:
            t = time.monotonic()
            await self._restart_in_place(instance, paths, image, chain)
            timings["parent_restore_ms"] = elapsed_ms(t)
        log.info(
            "gvisor snapshot of %s (stop=%s, %d layers): %s", instance.sandbox_id, stop, len(chain), timings
        )

    async def _snapshot_running(
        self, instance: SandboxInstance, paths: SandboxPaths, dest: SnapshotRef
    ) -> None:
        """A snapshot during which the sandbox only pauses (see :func:`checkpoint.checkpoint_running`)."""
        t = time.monotonic()
        image = dest.path / MEMORY_DIR
        chain = await checkpoint.checkpoint_running(self.runsc, self.disks, paths, instance.address, image)
        checkpoint.write_meta(dest.path, instance, chain)
        log.info(
            "gvisor snapshot of %s (running, %d layers): paused %s ms",
            instance.sandbox_id,
            len(chain),
            elapsed_ms(t),
        )

    async def _restart_in_place(
        self, instance: SandboxInstance, paths: SandboxPaths, image: Path, chain: list[str]
    ) -> None:
        """Bring a just-checkpointed sandbox back from ``image`` on its own network and disk."""
        try:
            if instance.template_rootfs is None or instance.network is None:
                raise Failed(f"sandbox {instance.sandbox_id} records no template root or network")
            disk_mb = GvisorState.of(instance).disk_mb
            await asyncio.to_thread(self.disks.mount, paths, Path(instance.template_rootfs), chain, disk_mb)
            await checkpoint.restore_container(self.runsc, paths, image, instance.network)
            self._guard_memory(paths)
            await self._wait_for_envd(paths, instance.envd_url, ENVD_RESTORE_TIMEOUT)
        except BaseException:
            log.exception("sandbox %s did not come back after its snapshot", instance.sandbox_id)
            raise

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        """A running sandbox ``spec.sandbox_id`` with the memory, processes and disk of ``source``.

        When ``spec.sandbox_id`` is the snapshotted sandbox itself and its scratch directory and
        network survived (a resume), it restores into them; otherwise it gets new ones."""
        paths = self.paths(spec.sandbox_id)
        meta = checkpoint.read_meta(source.path)
        saved_net = checkpoint.saved_network(meta)
        resume = meta.get("sandbox_id") == spec.sandbox_id and paths.root.is_dir()
        envd_bundle = await asyncio.to_thread(build_envd_bundle, self.settings)
        timings: dict[str, float] = {}
        net: SandboxNetwork | None = None
        # The network and the disk do not depend on each other: made at once (a restore's
        # network is ~14 ms of ip and iptables processes, its disk ~17 ms of mounts).
        net_step = asyncio.ensure_future(
            _timed(self._restore_network(spec, saved_net, resume), timings, "network_ms")
        )
        disk = checkpoint.mount_snapshot_disk(
            self.disks, paths, spec.template.rootfs, meta, resume=resume, disk_mb=spec.template.disk_mb
        )
        disk_step = asyncio.ensure_future(_timed(disk, timings, "disk_ms"))
        try:
            await _both(net_step, disk_step)
            net, rootfs = net_step.result(), disk_step.result()
            sudo_shim = bool(meta.get("sudo_shim"))  # as the checkpoint had it (older ones: none)
            spec = dataclasses.replace(spec, volumes=checkpoint.saved_volumes(meta))
            self._write_bundle(spec, net, rootfs, envd_bundle, sudo_shim)
            instance = self._instance(spec, net, envd_bundle, sudo_shim)
            t = time.monotonic()
            await checkpoint.restore_container(
                self.runsc, paths, source.path / MEMORY_DIR, net, fresh_network=net is not saved_net
            )
            self._guard_memory(paths)
            timings["runsc_restore_ms"] = elapsed_ms(t)
            t = time.monotonic()
            await self._wait_for_envd(paths, instance.envd_url, ENVD_RESTORE_TIMEOUT)
            timings["envd_ms"] = elapsed_ms(t)
        except BaseException:
            if net is None and net_step.done() and not net_step.cancelled() and not net_step.exception():
                net = net_step.result()  # made, though the disk failed: torn down with the rest
            await self._destroy(paths, net)
            raise
        log.info("gvisor restore of %s from %s: %s", spec.sandbox_id, source.snapshot_id, timings)
        return instance

    async def _restore_network(
        self, spec: SandboxSpec, saved: SandboxNetwork, resume: bool
    ) -> SandboxNetwork:
        """A resume keeps the sandbox's network (``saved``) when its netns survived; anything else
        gets a network (and slot) of its own."""
        if resume and await asyncio.to_thread(os.path.exists, saved.netns_path):
            return saved
        return await self._setup_network(spec)


async def _timed(step: Awaitable[T], timings: dict[str, float], key: str) -> T:
    started = time.monotonic()
    result = await step
    timings[key] = elapsed_ms(started)
    return result


async def _both(first: asyncio.Future[Any], second: asyncio.Future[Any]) -> None:
    """Until both steps ended, then raise the first one's failure, if any. A cancellation
    cancels both and still waits for them: what either made is undone only after it ended."""
    steps = {first, second}
    try:
        await asyncio.wait(steps)
    except asyncio.CancelledError:
        for step in steps:
            step.cancel()
        await asyncio.wait(steps)
        raise
    for step in (first, second):
        if step.cancelled():
            raise asyncio.CancelledError
        if (failure := step.exception()) is not None:
            raise failure


def _started_sentry(paths: SandboxPaths) -> int | None:
    """The live runsc sandbox process of ``paths``' container, by the pid file runsc wrote when
    it started it (checked against the process's command line: a pid can be reused)."""
    return watch.sentry_pid(paths.container_id, watch.read_pid(paths.sentry_pid_file))
