"""Where the files of one gVisor sandbox live, and the name runsc knows it by.

Per sandbox, under ``{data_dir}/sandboxes/<sandbox_id>/``::

    disk.img        the sandbox's disk: a sparse ext4 image of the template's ``diskSizeMB``
    disk/           its loop mount; ``upper/``, ``work/`` in it are the private writable layer
                    of the host overlayfs (its size is the sandbox's disk quota; snapshots seal it)
    rootfs/         overlay mount: upper over the snapshot layers over the template rootfs
    layers.json     the snapshot layers (newest first) the root stands on
    held-layers.json  layers copied from the upper for running snapshots (kept while the sandbox is)
    upper-delta.json  the upper's entries and the chain at the last running snapshot
    upper-copy/     the layer a running snapshot is copying from the upper, until it is adopted
    bundle/         OCI bundle (config.json) handed to runsc
    envd.log        envd's stdout/stderr;  runsc.log: runsc's own log
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Prefix of the runsc container id of every sandbox (crash recovery finds leaks by it).
CONTAINER_PREFIX = "ae-"


def sandboxes_dir(data_dir: Path) -> Path:
    """The directory holding one scratch directory per sandbox."""
    return data_dir / "sandboxes"


@dataclass(frozen=True)
class SandboxPaths:
    sandbox_id: str
    root: Path

    @classmethod
    def of(cls, data_dir: Path, sandbox_id: str) -> SandboxPaths:
        return cls(sandbox_id, sandboxes_dir(data_dir) / sandbox_id)

    @property
    def container_id(self) -> str:
        return CONTAINER_PREFIX + self.sandbox_id

    @property
    def disk_image(self) -> Path:
        return self.root / "disk.img"

    @property
    def disk(self) -> Path:
        return self.root / "disk"

    @property
    def upper(self) -> Path:
        return self.disk / "upper"

    @property
    def work(self) -> Path:
        return self.disk / "work"

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs"

    @property
    def upper_copy(self) -> Path:
        return self.root / "upper-copy"

    @property
    def upper_precopy(self) -> Path:
        return self.root / "upper-precopy"

    @property
    def upper_delta_file(self) -> Path:
        return self.root / "upper-delta.json"

    @property
    def held_layers_file(self) -> Path:
        return self.root / "held-layers.json"

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

    @property
    def sentry_pid_file(self) -> Path:
        """Where ``runsc run``/``restore`` write the pid of the sandbox's runsc sandbox process."""
        return self.root / "sentry.pid"
