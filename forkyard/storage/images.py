"""Guest artifacts for the microVM runtimes (QEMU, Firecracker), cached and content-addressed.

Under ``{data_dir}/images/``::

    debs/<package>.deb                     Debian cloud kernel package (apt-get download)
    kernel/<hash>/vmlinux                  uncompressed ELF kernel, extracted from the bzImage
    kernel/<hash>/initramfs.cpio           busybox-static + virtio/vsock/overlay modules + /init
    kernel/<hash>/manifest.json
    rootfs/<template_id>-<hash>.ext4       read-only ext4 of the template rootfs (mkfs.ext4 -d)
    envd/<bundle_hash>.ext4                read-only ext4 of the envd bundle (mounted at /.forkyard)
    upper/upper-<size_mb>.ext4             empty sparse ext4: per-sandbox upper drives are
                                           reflink clones of it (:mod:`forkyard.storage.reflink`)

Every artifact is built in a temporary file renamed into place under an exclusive ``flock``,
so concurrent builders wait for and then reuse the first one's result, and readers never see
a partial file. The hash covers every input (package bytes, init script, module list, this
builder's format version; for a rootfs, the listing of every file with size and mtime).

Guest boot: the kernel runs ``/init`` from the initramfs, which loads the modules, finds the
drives by their virtio serial (``base``, ``upper``, ``envd``), mounts base read-only, the
upper ext4 read-write, an overlayfs of both as the new root, the envd drive at ``/.forkyard``,
configures ``eth0`` from ``forkyard.ip=``/``forkyard.gw=`` on the kernel command line and
``exec``\\ s envd as PID 1 (envd reaps orphaned zombies itself when it is PID 1).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import RegistryMirror, Settings
from forkyard.errors import Failed, Gone
from forkyard.storage.atomic import exclusive, publish, write_atomic
from forkyard.storage.envd_bundle import MOUNT_POINT, build_envd_bundle, envd_argv, envd_env
from forkyard.storage.reflink import ReflinkPool

#: Bump when the layout or the init script changes in a way the hashed inputs do not show.
IMAGE_FORMAT = 1
KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX = Path("/bin/busybox")
#: Modules the guest needs; their dependencies come from modules.dep. Built-in ones are skipped.
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "vmw_vsock_virtio_transport",
    "virtio_balloon",
    "overlay",
    "ext4",
    "erofs",
)
#: Serial numbers the runtimes give the virtio-blk drives; /init finds the drives by them.
DRIVE_SERIALS = ("base", "upper", "envd")
DEFAULT_UPPER_MB = 4096


class ImageError(Failed):
    """A guest artifact could not be built."""


@dataclass(frozen=True)
class GuestKernel:
    vmlinux: Path
    initramfs: Path
    release: str


@dataclass(frozen=True)
class GuestImages:
    """Everything a microVM needs for one template (all shared and read-only)."""

    kernel: GuestKernel
    base: Path
    envd: Path
    upper_template: Path

    def to_json(self) -> dict[str, str]:
        return {
            "vmlinux": str(self.kernel.vmlinux),
            "initramfs": str(self.kernel.initramfs),
            "release": self.kernel.release,
            "base": str(self.base),
            "envd": str(self.envd),
            "upper_template": str(self.upper_template),
        }

    @classmethod
    def from_json(cls, data: dict[str, str]) -> GuestImages:
        missing = [k for k in ("vmlinux", "initramfs", "base", "envd") if not Path(data[k]).exists()]
        if missing:
            raise Gone(f"guest artifacts of this snapshot are gone: {', '.join(missing)}")
        kernel = GuestKernel(Path(data["vmlinux"]), Path(data["initramfs"]), data["release"])
        return cls(kernel, Path(data["base"]), Path(data["envd"]), Path(data["upper_template"]))

    def cmdline(self, guest_ip: str, gateway: str, prefixlen: int = 30, console: str = "ttyS0") -> str:
        return (
            f"console={console} reboot=k panic=-1 loglevel=4 "
            f"forkyard.ip={guest_ip}/{prefixlen} forkyard.gw={gateway}"
        )


def images_dir(settings: Settings) -> Path:
    return settings.data_dir / "images"


def digest_memo(settings: Settings) -> Path:
    """Where artifact keys' digests are remembered (:func:`_memoized`)."""
    return images_dir(settings) / "digests"


# -- helpers ------------------------------------------------------------------------------------


def _run(*cmd: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=cwd)
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout).strip()[-800:]
        raise ImageError(f"{' '.join(cmd)} failed ({proc.returncode}): {output}")
    return proc.stdout


def _sha256_file(path: Path, memo: Path | None = None) -> str:
    """sha256 of a file's content; with ``memo`` (a directory), remembered per (path, size,
    mtime), as a slow disk or an emulated CPU takes long to hash a kernel package."""
    if memo is None:
        return _sha256_content(path)
    st = path.stat()
    return _memoized(
        memo, f"file\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}", lambda: _sha256_content(path)
    )


def _memoized(memo: Path, identity: str, compute: Callable[[], str]) -> str:
    """A digest remembered on disk under ``memo`` by an identity of what it digests. A memo that
    cannot be written (a read-only share of another node's images) only costs the recomputation."""
    entry = memo / hashlib.sha256(identity.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        return entry.read_text().strip()
    digest = compute()
    with contextlib.suppress(OSError):
        memo.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, digest + "\n")
    return digest


def rootfs_digest(rootfs: Path, memo: Path) -> str:
    """:func:`tree_digest` of a template's root, remembered per build of it: the template's
    ``.complete`` marker (written last by every build, with the build's time and id) and the
    root directory's path and mtime identify one build, as the in-memory guest image cache's
    key does (a rebuild renames a new root into place). Walking the tree takes ~1 s here, minutes
    on a network file system under emulation (the emulated KVM host's node reads the template
    over 9p). A root without a marker (not a template build) is walked every time."""
    real = rootfs.resolve()
    try:
        marker = (real.parent / ".complete").read_text()
        mtime = real.stat().st_mtime_ns
    except OSError:
        return tree_digest(rootfs)
    return _memoized(memo, f"rootfs\0{real}\0{mtime}\0{marker}", lambda: tree_digest(rootfs))


def _sha256_content(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """Hash of a directory tree's listing (path, type, mode, size, mtime, link target): cheap,
    and changes whenever a template is rebuilt or edited."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else ""
            rel = os.path.relpath(p, root)
            h.update(f"{rel}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{target}\n".encode())
    return h.hexdigest()


# -- kernel -------------------------------------------------------------------------------------


def kernel_package_name() -> str:
    """The versioned kernel package ``linux-image-cloud-amd64`` currently depends on."""
    out = _run("apt-cache", "depends", KERNEL_META_PACKAGE)
    for line in out.splitlines():
        m = re.match(r"\s*Depends:\s*(linux-image-\S+-cloud-amd64)$", line)
        if m:
            return m.group(1)
    raise ImageError(f"apt-cache depends {KERNEL_META_PACKAGE}: no linux-image dependency in {out!r}")


def download_kernel_package(settings: Settings) -> Path:
    debs = images_dir(settings) / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    package = kernel_package_name()
    existing = sorted(debs.glob(f"{package}_*.deb"))
    if existing:
        return existing[-1]
    with exclusive(debs / ".lock"):
        existing = sorted(debs.glob(f"{package}_*.deb"))
        if existing:
            return existing[-1]
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=debs))
        try:
            os.chmod(tmp, 0o777)  # apt drops privileges to _apt for the download
            _run("apt-get", "download", "-q", package, cwd=tmp)
            got = sorted(tmp.glob(f"{package}_*.deb"))
            if not got:
                raise ImageError(f"apt-get download {package} produced no .deb")
            final = debs / got[0].name
            publish(got[0], final)
            return final
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


#: Magic bytes of the compressed payload formats the x86 kernel can use, as they start it.
_PAYLOAD_MAGICS = {
    b"\x1f\x8b": "gzip",
    b"\xfd7zXZ\x00": "xz",
    b"\x02\x21\x4c\x18": "lz4",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\x5d\x00\x00": "lzma",
}


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed ELF kernel inside an x86 bzImage.

    The boot protocol (2.08+) header gives where the compressed payload lies inside the
    protected-mode part: ``payload_offset`` at 0x248 and ``payload_length`` at 0x24c."""
    if bzimage[0x202:0x206] != b"HdrS":
        raise ImageError("not a bzImage: no HdrS boot header")
    version = struct.unpack_from("<H", bzimage, 0x206)[0]
    if version < 0x208:
        raise ImageError(f"boot protocol {version:#x} too old: no payload_offset")
    setup_sects = bzimage[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + payload_offset
    payload = bzimage[start : start + payload_length]
    kind = next((k for magic, k in _PAYLOAD_MAGICS.items() if payload.startswith(magic)), None)
    if kind is None:
        raise ImageError(f"unknown kernel payload compression (starts {payload[:6].hex()})")
    out = _decompress(kind, payload)
    if not out.startswith(b"\x7fELF"):
        raise ImageError(f"decompressed {kind} payload is not an ELF file")
    return out


def _decompress(kind: str, payload: bytes) -> bytes:
    if kind == "gzip":
        return gzip.decompress(payload)
    if kind == "xz":
        return lzma.decompress(payload, format=lzma.FORMAT_XZ)
    if kind == "lzma":
        return lzma.decompress(payload, format=lzma.FORMAT_ALONE)
    if kind == "lz4":
        return _lz4_legacy_decompress(payload)
    raise ImageError(f"kernel payload compression {kind} is not supported by this builder")


def _lz4_legacy_decompress(payload: bytes) -> bytes:
    """The kernel's lz4 is the legacy frame: magic, then blocks of ``<u32 size><data>``, each
    decoding to at most 8 MiB; the build appends the uncompressed size (4 bytes) at the end."""
    import lz4.block

    block_max = 8 << 20
    pos, out = 4, bytearray()
    while pos + 4 <= len(payload):
        (size,) = struct.unpack_from("<I", payload, pos)
        if size == 0x184C2102:  # a concatenated next frame
            pos += 4
            continue
        if pos + 4 + size > len(payload):
            break  # the trailing size field
        out += lz4.block.decompress(payload[pos + 4 : pos + 4 + size], uncompressed_size=block_max)
        pos += 4 + size
    return bytes(out)


def _resolve_modules(modroot: Path, release: str, wanted: tuple[str, ...]) -> list[str]:
    """Relative paths of the .ko files ``wanted`` need, dependencies first (modules.dep order)."""
    dep_file = modroot / "lib" / "modules" / release / "modules.dep"
    if not dep_file.exists():
        # The package ships no modules.dep (the postinst generates it); make one for the tree.
        _run("depmod", "-b", str(modroot), release)
    deps: dict[str, list[str]] = {}
    for line in dep_file.read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
    by_name = {Path(m).name.split(".ko")[0].replace("-", "_"): m for m in deps}
    builtin = {
        Path(line.strip()).name.split(".ko")[0].replace("-", "_")
        for line in (dep_file.parent / "modules.builtin").read_text().splitlines()
    }
    ordered: list[str] = []

    def visit(mod: str) -> None:
        if mod in ordered:
            return
        # modules.dep lists the full transitive closure; load the deepest first.
        for dep in reversed(deps[mod]):
            visit(dep)
        ordered.append(mod)

    for name in wanted:
        if name in builtin:
            continue
        if name not in by_name:
            raise ImageError(f"kernel {release} has no module {name}")
        visit(by_name[name])
    return ordered


INIT_SCRIPT = r"""#!/bin/busybox sh
# forkyard guest init (initramfs): modules, drives, overlay root, network, then envd as PID 1.
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /run
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "forkyard-init: $*" > /dev/console; sleep 1; echo o > /proc/sysrq-trigger; poweroff -f; }
for m in $(cat /modules.order); do insmod "/modules/$m" || fail "insmod $m"; done
# Drives are found by their virtio serial (the device order is not stable across machines): the
# drive's name (QEMU), or what forkyard.serial.<name>= says (Firecracker derives serials from the
# host file, the runtime computes them).
serial_of() {
  for arg in $(cat /proc/cmdline); do
    case "$arg" in forkyard.serial.$1=*) echo "${arg#*=}"; return 0 ;; esac
  done
  echo "$1"
}
drive() {
  want=$(serial_of "$1")
  for i in $(seq 1 200); do
    for b in /sys/block/vd*; do
      [ -e "$b/serial" ] && [ "$(cat $b/serial)" = "$want" ] && { echo "/dev/${b##*/}"; return 0; }
    done
    usleep 10000
  done
  return 1
}
BASE=$(drive base) || fail "no base drive"
UPPER=$(drive upper) || fail "no upper drive"
ENVD=$(drive envd) || fail "no envd drive"
mkdir -p /lower /upper /newroot
mount -o ro "$BASE" /lower || fail "mount base"
mount -o rw,noatime "$UPPER" /upper || fail "mount upper"
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot \
  || fail "overlay"
mkdir -p /newroot/.forkyard /newroot/proc /newroot/sys /newroot/dev /newroot/tmp /newroot/run
mount -o ro "$ENVD" /newroot/.forkyard || fail "mount envd"
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    forkyard.ip=*) IP="${arg#forkyard.ip=}" ;;
    forkyard.gw=*) GW="${arg#forkyard.gw=}" ;;
  esac
done
ip link set lo up
if [ -n "$IP" ]; then
  ip addr add "$IP" dev eth0 || fail "ip addr $IP"
  ip link set eth0 up
  [ -n "$GW" ] && ip route add default via "$GW"
fi
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp 2>/dev/null
mount -t tmpfs -o mode=755 tmpfs /newroot/run
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
echo "forkyard-init: starting envd" > /dev/console
# env -i runs here, from the initramfs: the template's root file system needs no env binary.
exec /bin/env -i @ENVD_ENV@ /bin/switch_root /newroot @ENVD_ARGV@
"""


def init_script() -> str:
    env = " ".join(f"{k}='{v}'" for k, v in envd_env().items())
    argv = " ".join(envd_argv(mount_point=MOUNT_POINT))
    # env -i clears the initramfs environment, so envd and its children see only envd_env().
    return INIT_SCRIPT.replace("@ENVD_ENV@", env).replace("@ENVD_ARGV@", argv)


#: /dev/console (5, 1): the kernel opens it for init's stdio before devtmpfs is mounted.
_DEVICE_NUMBERS = {"dev/console": (5, 1)}


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio "newc" archive of (name, mode, data); symlinks carry their target as data."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        nameb = name.encode() + b"\0"
        rmajor, rminor = _DEVICE_NUMBERS.get(name, (0, 0))
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rmajor, rminor, len(nameb), 0)
        header = "070701" + "".join(f"{v:08x}" for v in fields)
        out += header.encode() + nameb
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def build_kernel(settings: Settings) -> GuestKernel:
    """vmlinux + initramfs from the Debian cloud kernel (downloaded once, then cached)."""
    deb = download_kernel_package(settings)
    modules = GUEST_MODULES
    script = init_script()
    key = hashlib.sha256(
        json.dumps(
            [IMAGE_FORMAT, _sha256_file(deb, digest_memo(settings)), script, modules, _sha256_file(BUSYBOX)]
        ).encode()
    ).hexdigest()[:16]
    root = images_dir(settings) / "kernel"
    final = root / key
    if (final / "manifest.json").exists():
        return _kernel_from(final)
    with exclusive(root / ".lock"):
        if (final / "manifest.json").exists():
            return _kernel_from(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root))
        try:
            _assemble_kernel(tmp, deb, modules, script)
            tmp.chmod(0o755)
            publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _kernel_from(final)


def _kernel_from(directory: Path) -> GuestKernel:
    manifest = json.loads((directory / "manifest.json").read_text())
    return GuestKernel(directory / "vmlinux", directory / "initramfs.cpio", manifest["release"])


def _assemble_kernel(dest: Path, deb: Path, modules: tuple[str, ...], script: str) -> None:
    unpacked = dest / "deb"
    _run("dpkg-deb", "-x", str(deb), str(unpacked))
    vmlinuz = sorted((unpacked / "boot").glob("vmlinuz-*"))
    if not vmlinuz:
        raise ImageError(f"{deb.name} contains no /boot/vmlinuz-*")
    release = vmlinuz[0].name.removeprefix("vmlinuz-")
    (dest / "vmlinux").write_bytes(extract_vmlinux(vmlinuz[0].read_bytes()))
    mod_base = unpacked / "lib" / "modules" / release
    ordered = _resolve_modules(unpacked, release, modules)
    entries: list[tuple[str, int, bytes]] = [
        ("bin", stat.S_IFDIR | 0o755, b""),
        ("bin/busybox", stat.S_IFREG | 0o755, BUSYBOX.read_bytes()),
        ("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
        ("init", stat.S_IFREG | 0o755, script.encode()),
        ("dev", stat.S_IFDIR | 0o755, b""),
        ("dev/console", stat.S_IFCHR | 0o600, b""),
        ("modules", stat.S_IFDIR | 0o755, b""),
        ("modules.order", stat.S_IFREG | 0o644, "".join(Path(m).name + "\n" for m in ordered).encode()),
    ]
    for mod in ordered:
        entries.append((f"modules/{Path(mod).name}", stat.S_IFREG | 0o644, (mod_base / mod).read_bytes()))
    (dest / "initramfs.cpio").write_bytes(_cpio_newc(entries))
    shutil.rmtree(unpacked)
    manifest = {"release": release, "package": deb.name, "modules": ordered, "format": IMAGE_FORMAT}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


# -- disk images --------------------------------------------------------------------------------


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def make_ext4_from_dir(source: Path, dest: Path, *, label: str, extra_mb: int = 64) -> Path:
    """A minimal ext4 image holding ``source`` (``mkfs.ext4 -d``: no loop mount, no root-owned
    mount point). Sized to the tree plus 15 % + ``extra_mb`` of slack, written sparse."""
    size = int(_tree_bytes(source) * 1.15) + (extra_mb << 20)
    size = (size + (1 << 20) - 1) & ~((1 << 20) - 1)
    with open(dest, "wb") as f:
        f.truncate(size)
    _run(
        "mkfs.ext4",
        "-q",
        "-F",
        "-L",
        label,
        "-E",
        "root_owner=0:0",
        "-O",
        "^has_journal",
        "-m",
        "0",
        "-i",
        "8192",
        "-d",
        str(source),
        str(dest),
    )
    return dest


def _build_cached(directory: Path, name: str, builder: Callable[[Path], object]) -> Path:
    """``directory/name``, built by ``builder(tmp)`` and published once, unless it is there."""
    final = directory / name
    if final.exists():
        return final
    with exclusive(directory / ".lock"):
        if final.exists():
            return final
        tmp = directory / f".{name}.tmp"
        try:
            builder(tmp)
            # Durable before it has its name: a cached artifact is never rebuilt, so a torn
            # one after a crash would stay broken.
            publish(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return final


def build_base_image(settings: Settings, template_id: str, rootfs: Path) -> Path:
    digest = rootfs_digest(rootfs, digest_memo(settings))
    key = hashlib.sha256(f"{IMAGE_FORMAT}\0{digest}".encode()).hexdigest()[:16]
    directory = images_dir(settings) / "rootfs"
    directory.mkdir(parents=True, exist_ok=True)
    return _build_cached(
        directory,
        f"{template_id}-{key}.ext4",
        lambda tmp: make_ext4_from_dir(rootfs, tmp, label="forkyard-base"),
    )


def build_envd_image(settings: Settings) -> Path:
    bundle = build_envd_bundle(settings)
    directory = images_dir(settings) / "envd"
    directory.mkdir(parents=True, exist_ok=True)
    return _build_cached(
        directory,
        f"{bundle.name}-f{IMAGE_FORMAT}.ext4",
        lambda tmp: make_ext4_from_dir(bundle, tmp, label="forkyard-envd", extra_mb=16),
    )


def build_upper_template(settings: Settings, size_mb: int = DEFAULT_UPPER_MB) -> Path:
    """An empty, sparse ext4 of ``size_mb``: per-sandbox upper drives are reflink clones of it.

    Lives in the reflink pool so that clones share its blocks."""
    directory = ReflinkPool(settings.data_dir).ensure() / "templates"
    directory.mkdir(parents=True, exist_ok=True)

    def make(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.truncate(size_mb << 20)
        _run(
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "forkyard-upper",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
            str(tmp),
        )

    return _build_cached(directory, f"upper-{size_mb}-f{IMAGE_FORMAT}.ext4", make)


def build_guest_images(
    settings: Settings, template_id: str, rootfs: Path, upper_mb: int = DEFAULT_UPPER_MB
) -> GuestImages:
    """All artifacts for ``template_id`` (each built only when missing)."""
    if not rootfs.is_dir():
        raise ImageError(f"template rootfs {rootfs} does not exist (forkyard template build {template_id})")
    return GuestImages(
        kernel=build_kernel(settings),
        base=build_base_image(settings, template_id, rootfs),
        envd=build_envd_image(settings),
        upper_template=build_upper_template(settings, upper_mb),
    )


def create_upper_drive(settings: Settings, images: GuestImages, dest: Path) -> Path:
    """A sandbox's private writable drive: a reflink clone of the empty upper template."""
    pool = ReflinkPool(settings.data_dir)
    pool.ensure()
    return pool.clone(images.upper_template, dest)


# -- OCI images as template roots (template builds' ``fromImage``) -------------------------------


@dataclass(frozen=True)
class OciImageConfig:
    """What a template build takes over from an image's config: its environment and work dir."""

    env: dict[str, str]
    workdir: str | None
    user: str | None


def oci_reference(image: str) -> str:
    """``skopeo``'s ``docker://`` reference of an image name as Docker writes it: no registry
    host means Docker Hub, a one-part name an official image (``python:3`` ->
    ``docker.io/library/python:3``)."""
    if not image or any(c.isspace() for c in image):
        raise ImageError(f"invalid image name {image!r}")
    first, _, rest = image.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"):
        image = f"docker.io/{image if rest else 'library/' + image}"
    return "docker://" + image


def _loopback_registry(reference: str) -> bool:
    return _loopback_host(reference.removeprefix("docker://").split("/", 1)[0])


def _loopback_host(host_port: str) -> bool:
    host = host_port.rsplit(":", 1)[0]
    return host in ("localhost", "127.0.0.1", "[::1]") or host.startswith("127.")


#: Names Docker Hub's registry goes by; a mirror configured under any of them mirrors ``docker.io``.
DOCKER_HUB_ALIASES = ("docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com")


def registry_of(image: str) -> str:
    """The registry host an image name pulls from (``ubuntu:22.04`` -> ``docker.io``)."""
    return oci_reference(image).removeprefix("docker://").split("/", 1)[0]


def _mirror_for(registry: str, mirrors: Mapping[str, RegistryMirror]) -> RegistryMirror | None:
    for name, mirror in mirrors.items():
        key = name.strip().lower().rstrip("/")
        if key == registry or (registry == "docker.io" and key in DOCKER_HUB_ALIASES):
            return mirror
    return None


def pull_image_rootfs(
    image: str,
    dest: Path,
    work: Path,
    *,
    username: str | None = None,
    password: str | None = None,
    mirrors: Mapping[str, RegistryMirror] | None = None,
) -> OciImageConfig:
    """Pull ``image`` from its registry with skopeo into an OCI layout under ``work`` and unpack
    it with umoci; its root file system becomes ``dest`` (which must not exist). Registries on
    loopback are spoken to over plain HTTP (a local registry has no certificate), others over TLS.

    A mirror of the image's registry in ``mirrors`` (the node's ``registry_mirrors``) is tried
    first, the registry after it (skopeo's ``registries.conf`` mirrors, in a file of this pull's:
    the host's own mirrors do not change what a build pulls)."""
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} is not installed (apt-get install {tool}; scripts/bootstrap.sh does)")
    reference = oci_reference(image)
    work.mkdir(parents=True, exist_ok=True)
    layout = work / "oci"
    bundle = work / "bundle"
    registry = registry_of(image)
    mirror = _mirror_for(registry, mirrors or {})
    cmd = ["skopeo"]
    if mirror is not None:
        cmd += ["--registries-conf", str(_write_registries_conf(work, registry, mirror))]
    cmd += ["copy", "--quiet", "--retry-times", "2"]
    if _loopback_registry(reference):
        cmd.append("--src-tls-verify=false")
    auths: dict[str, tuple[str, str]] = {}
    if username is not None:
        auths[registry] = (username, password or "")
    if mirror is not None and mirror.username is not None:
        auths[mirror.location.split("/", 1)[0]] = (mirror.username, mirror.password or "")
    if auths:
        # An auth file, not ``--src-creds``: credentials stay out of argv (``ps``) and out of
        # the command line a failure's message repeats (it goes to the build's logs).
        cmd += ["--src-authfile", str(_write_authfile(work, auths))]
    try:
        _run(*cmd, reference, f"oci:{layout}:image")
    except ImageError as exc:
        if mirror is None:
            raise
        raise ImageError(f"through the mirror {mirror.location} of {registry}: {exc.message}") from None
    finally:
        (work / "auth.json").unlink(missing_ok=True)
    _run("umoci", "unpack", "--image", f"{layout}:image", str(bundle))
    config = _bundle_config(bundle / "config.json")
    os.rename(bundle / "rootfs", dest)
    shutil.rmtree(work, ignore_errors=True)
    return config


def _write_registries_conf(work: Path, registry: str, mirror: RegistryMirror) -> Path:
    """A containers-registries.conf (v2) naming ``mirror`` for ``registry``: skopeo tries the
    mirror, then the registry itself."""
    insecure = mirror.insecure or _loopback_host(mirror.location.split("/", 1)[0])
    text = (
        "unqualified-search-registries = []\n\n[[registry]]\n"
        f"prefix = {json.dumps(registry)}\nlocation = {json.dumps(registry)}\n"
        f"\n[[registry.mirror]]\nlocation = {json.dumps(mirror.location)}\n"
        f"insecure = {'true' if insecure else 'false'}\n"
    )
    path = work / "registries.conf"
    path.write_text(text)
    return path


def _write_authfile(work: Path, auths: dict[str, tuple[str, str]]) -> Path:
    """A containers-auth.json (mode 0600) with the credentials of each registry host."""
    entries = {
        host: {"auth": base64.b64encode(f"{username}:{password}".encode()).decode()}
        for host, (username, password) in auths.items()
    }
    path = work / "auth.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": entries}, f)
    return path


def _bundle_config(path: Path) -> OciImageConfig:
    """The image's environment, work dir and user, from the runtime config umoci generated."""
    process = json.loads(path.read_text()).get("process", {})
    env = dict(item.split("=", 1) for item in process.get("env", []) if "=" in item)
    user = (process.get("user") or {}).get("username") or None
    return OciImageConfig(env=env, workdir=process.get("cwd") or None, user=user)
