"""gVisor snapshots: ``runsc checkpoint`` / ``runsc restore`` plus the sandbox's disk layer.

A snapshot directory (``SnapshotRef.path``) holds::

    memory/checkpoint.img   the sentry's state file (kernel, processes, page cache, netstack)
    meta.json               what a restore needs: the network the netstack was saved with, the
                            chain of disk layers (newest first) the sandbox's root stood on, ...

The disk is incremental: at the checkpoint the sandbox's overlay upper (what it wrote since its
previous snapshot) is sealed into a new read-only layer of the runtime's layer store and the
sandbox carries on over it with an empty upper. A snapshot only names its chain; every sandbox
made from it mounts that chain under an upper of its own, so creating one copies nothing, and a
layer is freed only once no snapshot and no sandbox names it (deleting a snapshot never breaks
its descendants).

Why this shape (see docs/SNAPSHOTS.md for the numbers):

* runsc moves the veth's address into its netstack and removes it from the link. A restore
  builds a *new* netstack from what the link carries at that moment and the restored sockets
  (envd's listener) re-attach to it, so we put an address back on the link before restoring:
  the same one for a resume (a paused sandbox keeps its netns, veth and slot), the new slot's
  for a create-from-snapshot or fork child. Every sandbox stays addressed by its own slot.
* Before a checkpoint, the host's TCP connections to the sandbox are aborted (``ss -K``): this
  runsc rejects saving a connected TCP endpoint on a non-loopback NIC.
* ``runsc checkpoint`` always stops the sandbox on this runsc (``--leave-running`` is a
  checkpoint followed by an internal restore that fails the root-netns check, see
  :meth:`GvisorRuntime.hide_proc_sys_net`). For ``stop=False`` we do the same explicitly:
  checkpoint, seal the disk layer while nothing runs (so memory and disk agree), restore the
  parent in place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.types import ENVD_PORT
from agentenv.runtime import network
from agentenv.runtime.base import RuntimeError_
from agentenv.types import SandboxInstance, SandboxSpec, SnapshotRef, TemplateImage
from agentenv.runtime.network import SandboxNetwork

if TYPE_CHECKING:
    from agentenv.runtime.gvisor.runtime import GvisorRuntime

from agentenv.runtime.gvisor.runtime import CONTAINER_PREFIX, write_json

log = logging.getLogger(__name__)

MEMORY_DIR = "memory"
UPPER_DIR = "upper"
META_FILE = "meta.json"
RESTORE_TIMEOUT = 120.0
CHECKPOINT_ATTEMPTS = 5


def _ms(start: float) -> float:
    return round((time.monotonic() - start) * 1000, 1)


async def _run(*cmd: str, limit: float = 120.0) -> None:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), limit)
    if proc.returncode != 0:
        raise RuntimeError_(f"{' '.join(cmd[:3])} failed: {out.decode(errors='replace')[-1500:]}")


async def copy_tree(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src`` (reflinked blocks where the file system can)."""
    await _run("cp", "-a", "--reflink=auto", "--", str(src), str(dst))


def read_meta(path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((path / META_FILE).read_text())
    return meta


async def drop_host_connections(sandbox_ip: str) -> None:
    """Abort every host TCP connection to the sandbox (``ss -K``: the kernel sends a RST).

    runsc 2022-12 cannot save a connected TCP endpoint on an fdbased NIC ("save rejected due to
    unsupported networking state"); the host's keep-alive connections to envd (proxy, SDK,
    orchestrator) would block every checkpoint. Clients reconnect on their next request."""
    proc = await asyncio.create_subprocess_exec(
        "ss", "-K", "-t", "dst", sandbox_ip, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    await proc.wait()


async def checkpoint_container(runtime: GvisorRuntime, instance: SandboxInstance, image: Path) -> None:
    """``runsc checkpoint``: writes the state file and stops the sandbox."""
    from agentenv.runtime.gvisor.runtime import container_id

    cid = container_id(instance.sandbox_id)
    await asyncio.to_thread(image.mkdir, parents=True, exist_ok=True)
    out = ""
    for attempt in range(CHECKPOINT_ATTEMPTS):
        t = time.monotonic()
        await drop_host_connections(instance.address)
        log.info("checkpoint %s: ss -K %s ms", cid, _ms(t))
        t = time.monotonic()
        code, out = await runtime.run_runsc(
            "checkpoint", "--image-path", str(image), cid, check=False, limit=120
        )
        log.info("checkpoint %s: runsc checkpoint attempt %d: %s ms (exit %s)", cid, attempt, _ms(t), code)
        if code == 0:
            break
        if "save rejected" not in out:
            break
        # The RSTs had not reached the netstack yet, or a new connection raced in: try again.
        await asyncio.sleep(0.02 * (attempt + 1))
    else:
        code = 1
    if code != 0:
        reason = out.split("goroutine ")[0]
        tail = reason.rsplit("}: ", 1)[-1] if "}: " in reason else reason
        raise RuntimeError_(f"runsc checkpoint of sandbox {instance.sandbox_id} failed: {tail[:1500]}")
    t = time.monotonic()
    await forget_stopped_container(runtime, cid)
    log.info("checkpoint %s: forget stopped container %s ms", cid, _ms(t))


async def forget_stopped_container(runtime: GvisorRuntime, cid: str) -> None:
    """Drop runsc's record of a container whose sandbox exited after its checkpoint.

    ``runsc delete --force`` costs 1.3-1.6 s here even with nothing left to stop (it waits on
    the exited sandbox); the record is two files in the runsc root, and the sandbox/gofer
    processes are gone or get SIGKILLed by the reaper. The cgroup stays for the restore (a
    kill removes it). The gofer is matched by its bundle inside the sandbox directory: it must
    be gone too, or the root overlay stays busy and its upper cannot be sealed."""
    await runtime._reap_processes(cid, runtime.paths(cid.removeprefix(CONTAINER_PREFIX)).root)
    runtime.forget_container(cid)


async def readdress_link(net: SandboxNetwork) -> None:
    """Put the sandbox address and default route back on the netns side of the veth.

    runsc moves the link's addresses into its netstack and removes them from the host link; a
    restore builds a *new* netstack from what the link carries then (restored sockets re-attach
    to it), so the link must carry the address again -- the one of the slot the restored sandbox
    now has, which is what lets a fork child live at its own address."""
    await network.readdress(net)


async def restore_container(
    runtime: GvisorRuntime, sandbox_id: str, image: Path, net: SandboxNetwork
) -> None:
    """``runsc restore --detach`` of the bundle already written for ``sandbox_id``."""
    from agentenv.runtime.gvisor.runtime import container_id

    await readdress_link(net)
    paths = runtime.paths(sandbox_id)
    with paths.envd_log.open("ab") as out:
        cmd = runtime.runsc_cmd(
            *runtime.runsc_run_flags(), "restore", "--detach", "--bundle", str(paths.bundle),
            "--image-path", str(image), container_id(sandbox_id), log_file=paths.runsc_log,
        )
        proc = await asyncio.create_subprocess_exec(
            *runtime.hide_proc_sys_net(cmd), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
        )
        code = await asyncio.wait_for(proc.wait(), RESTORE_TIMEOUT)
    if code != 0:
        raise RuntimeError_(
            f"runsc restore of sandbox {sandbox_id} failed (exit {code}): {runtime._tail(paths.runsc_log)}"
        )


#: Deepest chain of snapshot layers a sandbox stands on before the oldest ones are squashed into
#: one (every file lookup that misses walks the whole chain; overlayfs allows far more).
MAX_CHAIN = 16
#: How many of the oldest layers one squash merges.
SQUASH_COUNT = MAX_CHAIN // 2


def _write_meta(dest: Path, instance: SandboxInstance, layers: list[str]) -> None:
    meta = {
        "format": 2,
        "runtime": "gvisor",
        "sandbox_id": instance.sandbox_id,
        "network": instance.state.get("network"),
        "template_id": instance.state.get("template_id"),
        "template_rootfs": instance.state.get("template_rootfs"),
        "platform": instance.state.get("platform"),
        "layers": layers,
        "created_at": time.time(),
    }
    tmp = dest / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, dest / META_FILE)


def snapshot_layers(path: Path) -> list[str]:
    """The disk layers (newest first) a snapshot directory's sandbox stood on."""
    try:
        return [str(lid) for lid in read_meta(path).get("layers") or []]
    except (OSError, ValueError):
        return []


async def seal_upper(runtime: GvisorRuntime, sandbox_id: str) -> list[str]:
    """Turn the stopped sandbox's upper layer into a shared read-only snapshot layer and give the
    sandbox a fresh, empty upper above it. Returns the sandbox's new chain (newest first).

    This is what makes snapshots incremental: the new layer holds exactly what the sandbox wrote
    since its previous snapshot (or since it was made), taken by one rename, however much it is.
    A chain deeper than :data:`MAX_CHAIN` gets its oldest layers squashed into one."""
    paths = runtime.paths(sandbox_id)
    await asyncio.to_thread(runtime.unmount_rootfs, sandbox_id)
    async with runtime.layer_lock:
        new_layer = await asyncio.to_thread(runtime.layers.adopt, paths.upper)
        chain = [new_layer, *runtime.sandbox_layers(sandbox_id)]
        if len(chain) > MAX_CHAIN:
            oldest = chain[-SQUASH_COUNT:]
            squashed = await asyncio.to_thread(runtime.layers.squash, oldest)
            chain = [*chain[:-SQUASH_COUNT], squashed]
        write_json(paths.layers_file, chain)
    await asyncio.to_thread(_fresh_dirs, paths.upper, paths.work)
    return chain


def _fresh_dirs(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()


async def snapshot(runtime: GvisorRuntime, instance: SandboxInstance, dest: SnapshotRef, stop: bool) -> None:
    """Checkpoint ``instance`` into ``dest.path``: memory image, meta, and the sandbox's disk as a
    chain of shared layers (its upper sealed into a new one, see :func:`seal_upper`).

    ``stop``: leave the sandbox stopped, its network (slot, netns) and scratch directory kept
    for a later resume; otherwise remount and restore it in place so it keeps running."""
    sid = instance.sandbox_id
    dest.path.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t = time.monotonic()
    await checkpoint_container(runtime, instance, dest.path / MEMORY_DIR)
    timings["checkpoint_ms"] = _ms(t)
    t = time.monotonic()
    chain = await seal_upper(runtime, sid)
    _write_meta(dest.path, instance, chain)
    timings["disk_seal_ms"] = _ms(t)
    if not stop:
        t = time.monotonic()
        try:
            template = Path(str(instance.state["template_rootfs"]))
            await asyncio.to_thread(runtime.mount_rootfs, sid, _template_of(instance, template), chain)
            net = SandboxNetwork.from_state(instance.state["network"])
            await restore_container(runtime, sid, dest.path / MEMORY_DIR, net)
            await runtime.wait_for_envd(sid, instance.envd_url, limit=30)
        except BaseException:
            log.exception("sandbox %s did not come back after its snapshot", sid)
            raise
        timings["parent_restore_ms"] = _ms(t)
    log.info("gvisor snapshot of %s (stop=%s, %d layers): %s", sid, stop, len(chain), timings)


def _template_of(instance: SandboxInstance, rootfs: Path) -> TemplateImage:
    return TemplateImage(template_id=str(instance.state.get("template_id", "")), rootfs=rootfs)


async def _mount_from_snapshot(
    runtime: GvisorRuntime, spec: SandboxSpec, source: SnapshotRef, meta: dict[str, Any], resume: bool
) -> Path:
    """Mount the sandbox's root on the snapshot's layers with a fresh upper. Snapshots written
    before layers existed (format 1) carry a whole upper directory: it is copied instead."""
    sid = spec.sandbox_id
    paths = runtime.paths(sid)
    if "layers" not in meta:
        if resume:
            await asyncio.to_thread(runtime.unmount_rootfs, sid)
            await asyncio.to_thread(_fresh_dirs, paths.upper, paths.work)
            shutil.rmtree(paths.upper)
        await copy_tree(source.path / UPPER_DIR, paths.upper)
        return await asyncio.to_thread(runtime.mount_rootfs, sid, spec.template, [])
    if resume:
        await asyncio.to_thread(runtime.unmount_rootfs, sid)
        await asyncio.to_thread(_fresh_dirs, paths.upper, paths.work)
    async with runtime.layer_lock:
        return await asyncio.to_thread(runtime.mount_rootfs, sid, spec.template, list(meta["layers"]))


async def restore(runtime: GvisorRuntime, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
    """A running sandbox ``spec.sandbox_id`` with the memory, processes and disk of ``source``.

    When ``spec.sandbox_id`` is the snapshotted sandbox itself and its scratch directory and
    network survived (a resume), it restores into them; otherwise it gets new ones."""
    from agentenv.storage.envd_bundle import build_envd_bundle

    sid = spec.sandbox_id
    meta = read_meta(source.path)
    old_net = SandboxNetwork.from_state(meta["network"])
    paths = runtime.paths(sid)
    resume = meta.get("sandbox_id") == sid and paths.root.is_dir()
    envd_bundle = await asyncio.to_thread(build_envd_bundle, runtime.settings)
    timings: dict[str, float] = {}
    net: SandboxNetwork | None = None
    try:
        t = time.monotonic()
        if resume and await asyncio.to_thread(os.path.exists, old_net.netns_path):
            net = old_net
        else:
            net = await runtime.setup_network(spec)
        timings["network_ms"] = _ms(t)
        t = time.monotonic()
        rootfs = await _mount_from_snapshot(runtime, spec, source, meta, resume)
        timings["disk_ms"] = _ms(t)
        runtime.write_oci_bundle(sid, runtime.oci_spec(spec, net, rootfs, envd_bundle))
        instance = runtime.instance_for(spec, net, envd_bundle)
        t = time.monotonic()
        await restore_container(runtime, sid, source.path / MEMORY_DIR, net)
        timings["runsc_restore_ms"] = _ms(t)
        t = time.monotonic()
        await runtime.wait_for_envd(sid, f"http://{net.sandbox_ip}:{ENVD_PORT}", limit=30)
        timings["envd_ms"] = _ms(t)
    except BaseException:
        await runtime._destroy(sid, net)
        raise
    log.info("gvisor restore of %s from %s: %s", sid, source.snapshot_id, timings)
    instance.state["restore_timings"] = timings
    return instance
