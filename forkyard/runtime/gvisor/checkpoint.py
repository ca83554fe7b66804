"""gVisor snapshots: ``runsc checkpoint`` / ``runsc restore`` plus the sandbox's disk layer.

The steps of a snapshot and a restore; :class:`~forkyard.runtime.gvisor.runtime.GvisorRuntime`
puts them together. A snapshot directory (``SnapshotRef.path``) holds::

    memory/                 runsc's image: checkpoint.img (the sentry's state: kernel,
                            processes, netstack), pages.img + pages_meta.img (memory pages)
    meta.json               what a restore needs: the network the netstack was saved with, the
                            chain of disk layers (newest first) the sandbox's root stood on, ...

The disk is incremental: at the checkpoint the sandbox's overlay upper (what it wrote since its
previous snapshot) is sealed into a new read-only layer of the layer store and the sandbox
carries on over it with an empty upper (a running snapshot of a small upper copies it instead,
see below). A snapshot only names its chain; every sandbox made from
it mounts that chain under an upper of its own, so creating one copies nothing, and a layer is
freed only once no snapshot and no sandbox names it (deleting a snapshot never breaks its
descendants).

Why this shape (see docs/SNAPSHOTS.md for the numbers):

* runsc moves the veth's address into its netstack and removes it from the link. A restore
  builds a *new* netstack from what the link carries at that moment and the restored sockets
  (envd's listener) re-attach to it, so we put an address back on the link before restoring:
  the same one for a resume (a paused sandbox keeps its netns, veth and slot), the new slot's
  for a create-from-snapshot or fork child. Every sandbox stays addressed by its own slot.
* Before a checkpoint, the host's TCP connections to the sandbox are aborted (``ss -K``): the
  restored netstack knows none of them, and a client that learns so only from a reset on its next
  request fails it; a killed connection is dropped from its pool unused. (runsc itself saves
  connected endpoints by disconnecting them, ``--net-disconnect-ok``.)
* Images are written uncompressed (``--compression=none``): compressing is most of the
  checkpoint's and the restore's CPU time, and the image sits in the page cache.
* A snapshot that keeps the sandbox running (:func:`checkpoint_running`) pauses it in the sentry,
  checkpoints with ``--leave-running``, copies its upper into a new layer while nothing runs (so
  memory and disk agree) and resumes it: its processes never stop existing. The upper cannot be
  sealed by a rename there (the running sandbox writes to it): the new layer is what the upper
  changed since the previous running snapshot (:mod:`~forkyard.runtime.gvisor.upper_delta`), so
  snapshots stay incremental. That is for small uppers (:func:`can_snapshot_running`); a large
  one takes the stopping path, checkpoint, seal, restore in place, which also leaves the sandbox
  an empty upper.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from forkyard.errors import Failed, Gone
from forkyard.runtime import network
from forkyard.runtime.gvisor.disk import RootDisks
from forkyard.runtime.gvisor.paths import SandboxPaths
from forkyard.runtime.gvisor.runsc import Runsc
from forkyard.runtime.gvisor.state import GvisorState
from forkyard.runtime.gvisor.upper_delta import Staged
from forkyard.runtime.network import SandboxNetwork
from forkyard.storage.atomic import write_json_atomic
from forkyard.types import SandboxInstance, VolumeMount

log = logging.getLogger(__name__)

MEMORY_DIR = "memory"
META_FILE = "meta.json"
#: Version of meta.json; 1 (snapshots that copied the whole upper) is no longer restorable.
META_FORMAT = 2
#: The checkpoint meta's list of the volumes bound when it was taken.
VOLUMES_META_KEY = "volumes"
#: Deepest chain of snapshot layers a sandbox stands on before the oldest ones are squashed into
#: one (every file lookup that misses walks the whole chain; overlayfs allows far more).
MAX_CHAIN = 16
#: How many of the oldest layers one squash merges.
SQUASH_COUNT = MAX_CHAIN // 2


def elapsed_ms(start: float) -> float:
    """Milliseconds since ``start`` (a ``time.monotonic()``), for the timing logs."""
    return round((time.monotonic() - start) * 1000, 1)


# -- meta.json ----------------------------------------------------------------------------------


def write_meta(dest: Path, instance: SandboxInstance, chain: list[str]) -> None:
    state = GvisorState.of(instance)
    write_json_atomic(
        dest / META_FILE,
        {
            "format": META_FORMAT,
            "runtime": "gvisor",
            "sandbox_id": instance.sandbox_id,
            "network": instance.network.to_state() if instance.network else None,
            "template_id": state.template_id or None,
            "template_rootfs": instance.template_rootfs,
            "platform": state.platform,
            # /usr/bin/sudo mounted over by envd's (a restore needs the mounts its checkpoint had)
            "sudo_shim": state.sudo_shim,
            # the volumes bound at checkpoint: the restore binds them again (runsc restores the
            # mounts its checkpoint had; the volume's files are the volume's, never copied here)
            VOLUMES_META_KEY: [v.to_state() for v in instance.volume_mounts],
            "layers": chain,
            "created_at": time.time(),
        },
        indent=2,
    )


def saved_volumes(meta: dict[str, Any]) -> tuple[VolumeMount, ...]:
    """The volumes the snapshot was taken with; :class:`Gone` when one was deleted since."""
    volumes = tuple(VolumeMount.from_state(v) for v in meta.get(VOLUMES_META_KEY) or ())
    for volume in volumes:
        if not os.path.isdir(volume.source):
            raise Gone(
                f"volume {volume.name!r} (mounted at {volume.path} when the snapshot was taken) "
                "was deleted: the snapshot cannot be restored without it"
            )
    return volumes


def read_meta(path: Path) -> dict[str, Any]:
    """The meta of the snapshot in ``path``; :class:`Gone` when it cannot be restored."""
    try:
        meta: dict[str, Any] = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise Gone(f"snapshot {path.name} has no readable {META_FILE}: {exc}") from exc
    if meta.get("format") != META_FORMAT:
        raise Gone(
            f"snapshot {path.name} has format {meta.get('format')}, this forkyard restores {META_FORMAT}"
        )
    return meta


def snapshot_layers(path: Path) -> list[str]:
    """The disk layers (newest first) a snapshot directory's sandbox stood on ([] if unreadable)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [str(lid) for lid in meta.get("layers") or []]


def saved_network(meta: dict[str, Any]) -> SandboxNetwork:
    """The network the snapshotted sandbox had (its netstack was saved with that address)."""
    try:
        return SandboxNetwork.from_state(meta["network"])
    except (KeyError, TypeError) as exc:
        raise Gone(f"snapshot of sandbox {meta.get('sandbox_id')} names no usable network: {exc!r}") from exc


# -- checkpoint -----------------------------------------------------------------------------------


async def drop_host_connections(sandbox_ip: str) -> None:
    """Abort every host TCP connection to the sandbox (``ss -K``: the kernel sends a RST and
    the clients' sockets close now, not at their next request)."""
    proc = await asyncio.create_subprocess_exec(
        "ss",
        "-K",
        "-t",
        "dst",
        sandbox_ip,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await proc.wait()


async def checkpoint_container(runsc: Runsc, paths: SandboxPaths, address: str, image: Path) -> None:
    """``runsc checkpoint`` into ``image``; the sandbox is stopped afterwards, its processes gone
    (the root overlay can be unmounted) and runsc's record of it dropped."""
    await asyncio.to_thread(image.mkdir, parents=True, exist_ok=True)
    await drop_host_connections(address)
    await _checkpoint(runsc, paths, image)
    t = time.monotonic()
    await runsc.stop(paths)
    log.info("checkpoint %s: stop the exited container %s ms", paths.sandbox_id, elapsed_ms(t))


async def checkpoint_running(
    runsc: Runsc, disks: RootDisks, paths: SandboxPaths, address: str, image: Path
) -> list[str]:
    """Checkpoint a sandbox that keeps running: memory into ``image``, its upper copied into a new
    layer. Returns the snapshot's chain (newest first); the sandbox's own chain is unchanged.

    The large files the copy needs are copied first, while the sandbox runs (pre-copy, see
    :mod:`~forkyard.runtime.gvisor.upper_delta`). Then the sandbox is paused in the sentry: a
    checkpoint of a paused sandbox leaves it paused, so nothing writes to the disk between the
    checkpoint (which flushes the sentry's file writes) and the copy, which links the pre-copied
    files that did not change and copies the rest."""
    await asyncio.to_thread(image.mkdir, parents=True, exist_ok=True)
    cid = paths.container_id
    t = time.monotonic()
    staged = await asyncio.to_thread(disks.precopy_upper, paths)
    log.info("checkpoint %s: pre-copy %d files %s ms", paths.sandbox_id, len(staged), elapsed_ms(t))
    try:
        t = time.monotonic()
        await runsc.pause(cid)
        try:
            await drop_host_connections(address)
            await _checkpoint(runsc, paths, image, "--leave-running")
            t_copy = time.monotonic()
            chain = await copy_upper(disks, paths, staged)
            log.info("checkpoint %s: copy the upper %s ms", paths.sandbox_id, elapsed_ms(t_copy))
        finally:
            await runsc.resume(cid)
            log.info("checkpoint %s: paused %s ms", paths.sandbox_id, elapsed_ms(t))
    finally:
        await asyncio.to_thread(disks.drop_precopy, paths)
    return chain


async def _checkpoint(runsc: Runsc, paths: SandboxPaths, image: Path, *flags: str) -> None:
    t = time.monotonic()
    code, out = await runsc.run(
        "checkpoint",
        "--compression=none",
        *flags,
        "--image-path",
        str(image),
        paths.container_id,
        check=False,
        limit=120,
    )
    log.info("checkpoint %s: runsc checkpoint %s ms (exit %s)", paths.sandbox_id, elapsed_ms(t), code)
    if code != 0:
        raise Failed(f"runsc checkpoint of sandbox {paths.sandbox_id} failed: {_checkpoint_error(out)}")


def _checkpoint_error(output: str) -> str:
    """The reason in runsc's checkpoint output, without the goroutine dump and log prefixes."""
    reason = output.split("goroutine ")[0]
    return (reason.rsplit("}: ", 1)[-1] if "}: " in reason else reason)[:1500]


async def seal_upper(disks: RootDisks, paths: SandboxPaths) -> list[str]:
    """Turn the stopped sandbox's upper into a shared read-only snapshot layer and give the
    sandbox a fresh, empty upper above it. Returns the sandbox's new chain (newest first).

    This is what makes snapshots incremental: the new layer holds exactly what the sandbox wrote
    since its previous snapshot (or since it was made): a copy of the upper, which lives on the
    sandbox's own size-limited disk (:mod:`~forkyard.runtime.gvisor.disk`), renamed into the
    store. A chain deeper than :data:`MAX_CHAIN` gets its oldest layers squashed into one."""
    await asyncio.to_thread(disks.unmount, paths)
    t = time.monotonic()
    copy = await asyncio.to_thread(disks.seal_copy, paths)
    log.info("checkpoint %s: copy the upper to seal it %s ms", paths.sandbox_id, elapsed_ms(t))
    async with disks.lock:
        new_layer = await asyncio.to_thread(disks.layers.adopt, copy)
        chain = [new_layer, *disks.chain(paths)]
        if len(chain) > MAX_CHAIN:
            squashed = await asyncio.to_thread(disks.layers.squash, chain[-SQUASH_COUNT:])
            chain = [*chain[:-SQUASH_COUNT], squashed]
        disks.set_chain(paths, chain)
    await asyncio.to_thread(disks.fresh_upper, paths)
    return chain


async def copy_upper(
    disks: RootDisks, paths: SandboxPaths, staged: dict[str, Staged] | None = None
) -> list[str]:
    """A new layer with what the (paused) sandbox's upper changed since its last running snapshot
    (all of it after a new mount); returns the chain of a snapshot taken now (newest first). The
    sandbox holds the layer until it is gone, so that a collection never frees it before the
    snapshot naming it is committed, and the next running snapshot can stack on it."""
    copy = await asyncio.to_thread(disks.copy_upper, paths, staged)
    async with disks.lock:
        new_layer = await asyncio.to_thread(disks.layers.adopt, copy.path)
        await asyncio.to_thread(disks.hold, paths, new_layer)
    chain = [new_layer, *copy.base]
    await asyncio.to_thread(disks.remember_delta, paths, chain, copy.entries)
    return chain


def can_snapshot_running(disks: RootDisks, paths: SandboxPaths) -> bool:
    """Whether a snapshot can leave the sandbox running: its upper is small enough to copy in the
    pause, and the layer stacks within :data:`MAX_CHAIN` (else the stopping path seals and squashes)."""
    return disks.upper_is_small(paths) and len(disks.delta_base(paths)[0]) < MAX_CHAIN


# -- restore --------------------------------------------------------------------------------------


async def mount_snapshot_disk(
    disks: RootDisks,
    paths: SandboxPaths,
    template_rootfs: Path,
    meta: dict[str, Any],
    *,
    resume: bool,
    disk_mb: int,
) -> Path:
    """Mount the sandbox's root on the snapshot's layers under an empty upper. On a resume the
    sandbox's own root is unmounted and emptied first: the snapshot's chain is all the disk the
    restored memory agrees with."""
    if resume:
        await asyncio.to_thread(disks.unmount, paths)
        await asyncio.to_thread(disks.fresh_upper, paths)
    async with disks.lock:
        return await asyncio.to_thread(disks.mount, paths, template_rootfs, list(meta["layers"]), disk_mb)


async def restore_container(
    runsc: Runsc, paths: SandboxPaths, image: Path, net: SandboxNetwork, *, fresh_network: bool = False
) -> None:
    """``runsc restore`` of the OCI bundle already written for the sandbox, onto ``net``.

    The link must carry the sandbox address again first (runsc took it off the link into the
    saved netstack): the address of the slot the restored sandbox now has, which is what lets a
    fork child live at its own address. A network just made for this restore (``fresh_network``:
    a fork child, a create from a snapshot) carries it already: it is not set twice."""
    if not fresh_network:
        await network.readdress(net)
    await runsc.start(paths, image=image)
