"""Shared, read-only overlayfs disk layers: what makes gVisor snapshots incremental.

A sandbox's root is a host overlayfs: its private upper directory over the template rootfs. At a
snapshot the upper (unmounted) is *renamed* into a :class:`LayerStore` as a new read-only layer,
O(1) however much the sandbox wrote, and the sandbox continues on a fresh empty upper with that
layer stacked as an extra lower. A snapshot is its chain of layer ids (newest first, the template
below them all); sandboxes made from it mount the same chain with their own upper. Layers are
shared, so one is deleted only when nothing references it (:meth:`LayerStore.gc`, the caller
computes the references).

Every lookup that misses walks the whole chain, so long chains get their oldest layers merged by
:meth:`LayerStore.squash`, which must honour overlayfs' own markers: whiteouts (a ``0:0`` character
device, or since Linux 6.7 an empty file with ``trusted.overlay.whiteout``) delete what is below,
and an opaque directory (``trusted.overlay.opaque=y``) hides everything below it.

Overlays are mounted with ``redirect_dir=off,metacopy=off,index=off``: renaming a lower directory
then copies it (EXDEV for ``rename(2)``, which ``mv`` handles) and a ``chmod`` copies the data, so an
upper is self-contained and can become a lower of any later mount; redirects and metacopy files
would point into the layers below by path and tie a layer to the exact stack it was written on.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import Counter
from pathlib import Path

from forkyard.errors import Failed
from forkyard.storage import mounts
from forkyard.storage.reflink import FICLONE

log = logging.getLogger(__name__)

LAYER_ID_PREFIX = "l"
#: Lowers one :func:`overlay_mount` guarantees to fit (the caller squashes long before: lookups
#: walk every layer). The real ceiling is the mount(2) option string, one page: layers are passed
#: relative to the store (18 bytes each), so 128 of them (2.3 KiB) leave ~1.7 KiB for the template,
#: upper and work paths. The kernel's own limit is 500 lowers.
MAX_LOWERS = 128
#: ``OVL_MAX_STACK`` in fs/overlayfs.
KERNEL_MAX_LOWERS = 500
#: mount(2) copies at most one page of options, NUL included, and silently truncates the rest.
MOUNT_DATA_MAX = 4095
#: Always passed: keeps every upper self-contained (see the module docstring).
OVERLAY_OPTIONS = "redirect_dir=off,metacopy=off,index=off"

OVERLAY_XATTR = "trusted.overlay."
#: ``trusted.overlay.overlay.*`` is an escaped, ordinary xattr of a file in the merged view.
ESCAPED_XATTR = "trusted.overlay.overlay."
OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT_XATTR = "trusted.overlay.whiteout"
#: Markers that refer into the layers below by path or data: a squash cannot resolve them.
UNSQUASHABLE_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")

TMP_PREFIX = ".tmp-"
_BUILD_PREFIX = TMP_PREFIX + "build-"
_ID_RE = re.compile(r"l[0-9a-f]{16}\Z")
_FORBIDDEN_IN_PATHS = (",", ":", "\\", "\n")

#: Temp directories squashes of this process are building right now: gc must not take them.
_building: set[str] = set()
_building_lock = threading.Lock()


class LayerError(Failed):
    """A layer operation failed: a bad or missing layer, an upper that cannot be adopted, an
    overlay that cannot be mounted."""


class LayerStore:
    """A directory of committed layers ``l<16 hex>/`` and crash leftovers ``.tmp-*``.

    Layer directories are created only by a rename, so a committed name is always complete."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, layer_id: str) -> Path:
        """The layer's directory; ``layer_id`` is checked because it ends up in paths and mounts."""
        if not _ID_RE.match(layer_id):
            raise LayerError(f"invalid disk layer id {layer_id!r}")
        return self.root / layer_id

    def exists(self, layer_id: str) -> bool:
        return self.path(layer_id).is_dir()

    def ids(self) -> set[str]:
        """Committed layers (not temp directories of builds or deletions)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {n for n in names if _ID_RE.match(n) and (self.root / n).is_dir()}

    def adopt(self, upper: Path) -> str:
        """Make the unmounted overlay upper ``upper`` a new layer by renaming it: no data is copied,
        which is why the store must be on the same file system as the sandboxes' uppers."""
        self._ensure_root()
        _check_adoptable(upper)
        layer_id = self._new_id()
        try:
            os.rename(upper, self.root / layer_id)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise _cross_device(upper, self.root) from None
            raise LayerError(f"cannot move {upper} into the layer store: {exc.strerror}") from None
        _fsync_dir(self.root)
        _fsync_dir(upper.parent)
        return layer_id

    def squash(self, layer_ids: list[str]) -> str:
        """One new layer equal to ``layer_ids`` (newest first) stacked, over whatever lies below
        the oldest of them. Whiteouts and opaque markers are kept: the layers below still exist.
        Built in a temp directory, synced, then renamed: a crash leaves only a temp for :meth:`gc`.
        The given layers are not changed."""
        if not layer_ids:
            raise LayerError("squash needs at least one layer")
        sources = [self.path(lid) for lid in layer_ids]
        missing = [lid for lid, src in zip(layer_ids, sources, strict=True) if not src.is_dir()]
        if missing:
            raise LayerError(f"cannot squash missing disk layers {', '.join(missing)}")
        tmp = self._start_build()
        try:
            _Squash().run(sources, tmp)
            _syncfs(tmp)
            layer_id = self._new_id()
            os.rename(tmp, self.root / layer_id)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            with _building_lock:
                _building.discard(tmp.name)
        _fsync_dir(self.root)
        return layer_id

    def remove(self, layer_id: str) -> None:
        """Delete a layer; a no-op when it is already gone. It is renamed away first, so a crash
        midway leaves a temp directory rather than a half-deleted layer someone might mount."""
        src = self.path(layer_id)
        doomed = self.root / f"{TMP_PREFIX}rm-{layer_id}-{secrets.token_hex(4)}"
        try:
            os.rename(src, doomed)
        except FileNotFoundError:
            return
        _fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def gc(self, in_use: set[str]) -> list[str]:
        """Delete the committed layers not in ``in_use`` and the leftovers of crashed builds and
        deletions (not builds in progress). Returns the deleted layer ids."""
        removed = sorted(self.ids() - in_use)
        for layer_id in removed:
            self.remove(layer_id)
        for name in self._leftovers():
            shutil.rmtree(self.root / name, ignore_errors=True)
        return removed

    def disk_usage(self, layer_id: str) -> int:
        """Bytes the layer allocates (``st_blocks``; hard-linked inodes counted once)."""
        return tree_bytes(self.path(layer_id))

    def _ensure_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def _new_id(self) -> str:
        while True:
            layer_id = LAYER_ID_PREFIX + secrets.token_hex(8)
            if not os.path.lexists(self.root / layer_id):
                return layer_id

    def _start_build(self) -> Path:
        self._ensure_root()
        tmp = self.root / f"{_BUILD_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        with _building_lock:
            _building.add(tmp.name)
        tmp.mkdir()
        return tmp

    def _leftovers(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [n for n in names if n.startswith(TMP_PREFIX) and not _build_in_progress(n)]


def _build_in_progress(name: str) -> bool:
    """Whether temp ``name`` is a squash still running here or in another live process."""
    if not name.startswith(_BUILD_PREFIX):
        return False
    with _building_lock:
        if name in _building:
            return True
    pid = name[len(_BUILD_PREFIX) :].split("-", 1)[0]
    return pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_adoptable(upper: Path) -> None:
    """Refuse what would silently corrupt a layer: a missing upper, or one a mount still writes to."""
    if upper.is_symlink() or not upper.is_dir():
        raise LayerError(f"{upper} is not a directory")
    if {os.path.abspath(upper), os.path.realpath(upper)} & _mounted_uppers():
        raise LayerError(f"{upper} is still the upper directory of a mounted overlay: unmount it first")


def _cross_device(upper: Path, root: Path) -> LayerError:
    return LayerError(
        f"cannot adopt {upper} into the layer store {root}: they are on different file systems "
        "(a layer is taken by rename; keep sandboxes and disk layers under the same data directory)"
    )


def _mounted_uppers() -> set[str]:
    """Upper directories of the overlays mounted in this mount namespace."""
    uppers: set[str] = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            _, _, tail = line.partition(" - ")
            fields = tail.split(" ")
            if len(fields) < 3 or fields[0] != "overlay":
                continue
            for opt in fields[2].rstrip("\n").split(","):
                if opt.startswith("upperdir="):
                    uppers.add(_unescape_mountinfo(opt[len("upperdir=") :]))
    return uppers


def _unescape_mountinfo(value: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), value)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs(path: Path) -> None:
    """Flush the file system holding ``path`` (one call instead of an fsync per copied file), so
    that a squashed layer is on disk before the layers it replaces can be collected."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> int:
    """Bytes the tree ``root`` allocates (``st_blocks``, hard-linked inodes counted once, symlinks
    not followed); 0 when it does not exist. Entries removed while it walks are skipped: the tree
    may be a running sandbox's upper."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


# --------------------------------------------------------------------------------------- squash


class _Squash:
    """Folds layers, oldest first, into one directory, the way overlayfs stacks them.

    ``covered`` marks a destination directory nothing below can show through (it or an ancestor
    is opaque): whiteouts there would be dead weight and are dropped."""

    def __init__(self) -> None:
        #: source inode -> (copy, copy's inode): hard links stay hard links within the result.
        self._links: dict[tuple[int, int], tuple[str, int]] = {}

    def run(self, sources: list[Path], dest: Path) -> None:
        for src in reversed(sources):
            self._links.clear()  # hard links never span layers
            self._merge_dir(str(src), str(dest), covered=False)
        # The merged root's own attributes are the top layer's.
        _copy_meta(str(sources[0]), os.lstat(sources[0]), str(dest))

    def _merge_dir(self, src: str, dest: str, covered: bool) -> None:
        with os.scandir(src) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            self._apply(entry.path, os.path.join(dest, entry.name), covered)

    def _apply(self, src: str, dest: str, covered: bool) -> None:
        st = os.lstat(src)
        if _is_whiteout(src, st):
            _remove(dest)
            if not covered:
                os.mknod(dest, stat.S_IFCHR, os.makedev(0, 0))
        elif stat.S_ISDIR(st.st_mode):
            self._apply_dir(src, st, dest, covered)
        else:
            _remove(dest)
            if not self._link(st, dest):
                _copy_node(src, st, dest)
                _copy_meta(src, st, dest)
                self._links[(st.st_dev, st.st_ino)] = (dest, os.lstat(dest).st_ino)

    def _apply_dir(self, src: str, st: os.stat_result, dest: str, covered: bool) -> None:
        """A directory merges with one below unless it is opaque; over a whiteout or a non-directory
        overlayfs stops looking further down, which in the result is an opaque directory."""
        below = _lstat(dest)
        if below is not None and stat.S_ISDIR(below.st_mode) and not _is_opaque(src):
            child_covered = covered or _is_opaque(dest)
        else:
            opaque = _is_opaque(src) or below is not None
            _remove(dest)
            os.mkdir(dest, 0o700)
            if opaque and not covered:
                os.setxattr(dest, OPAQUE_XATTR, b"y")
            child_covered = covered or opaque
        self._merge_dir(src, dest, child_covered)
        _copy_meta(src, st, dest)  # after the entries, so that the directory keeps its mtime

    def _link(self, st: os.stat_result, dest: str) -> bool:
        """Hard-link ``dest`` to an earlier copy of the same source inode, if that copy is intact."""
        if st.st_nlink < 2 or stat.S_ISDIR(st.st_mode):
            return False
        earlier = self._links.get((st.st_dev, st.st_ino))
        if earlier is None:
            return False
        path, ino = earlier
        current = _lstat(path)
        if current is None or current.st_ino != ino:
            return False
        os.link(path, dest, follow_symlinks=False)
        return True


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _is_whiteout(path: str, st: os.stat_result) -> bool:
    if stat.S_ISCHR(st.st_mode):
        return st.st_rdev == 0
    # Lookups treat an xattr whiteout as deleted whatever its parent says, so do we.
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and _getxattr(path, WHITEOUT_XATTR) is not None


def _is_opaque(path: str) -> bool:
    # "x" is not opaque: it marks a directory that holds xattr whiteouts.
    return _getxattr(path, OPAQUE_XATTR) == b"y"


def _getxattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return None
        raise


def _remove(path: str) -> None:
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _copy_node(src: str, st: os.stat_result, dest: str) -> None:
    mode = st.st_mode
    if stat.S_ISREG(mode):
        _copy_file(src, dest)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dest)
    else:  # devices, FIFOs, sockets
        os.mknod(dest, stat.S_IFMT(mode) | 0o600, st.st_rdev)


def _copy_meta(src: str, st: os.stat_result, dest: str) -> None:
    """Owner, mode, xattrs, times, in the order that keeps them: chown clears set-id bits and file
    capabilities, and every change before the times updates ctime/mtime."""
    os.lchown(dest, st.st_uid, st.st_gid)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest, stat.S_IMODE(st.st_mode))
    _copy_xattrs(src, dest)
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_xattrs(src: str, dest: str) -> None:
    """Make ``dest``'s xattrs ``src``'s (a directory's attributes are its top layer's), leaving
    out overlayfs' bookkeeping (origin file handles, impure, uuid) and keeping ``dest``'s opaque
    marker, which the squash manages."""
    wanted: dict[str, bytes] = {}
    for name in os.listxattr(src, follow_symlinks=False):
        if name in UNSQUASHABLE_XATTRS:
            raise LayerError(f"{src} has {name}: layers with redirects or metacopy cannot be squashed")
        if _portable_xattr(name):
            wanted[name] = os.getxattr(src, name, follow_symlinks=False)
    for name in os.listxattr(dest, follow_symlinks=False):
        if _portable_xattr(name) and name not in wanted:
            os.removexattr(dest, name, follow_symlinks=False)
    for name, value in wanted.items():
        os.setxattr(dest, name, value, follow_symlinks=False)


def _portable_xattr(name: str) -> bool:
    return not name.startswith(OVERLAY_XATTR) or name.startswith(ESCAPED_XATTR)


def _copy_file(src: str, dest: str) -> None:
    """Reflink where the file system can (XFS, btrfs), else an in-kernel copy that skips holes."""
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fout = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if not _clone(fin, fout):
                _copy_data(fin, fout, os.fstat(fin).st_size)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _clone(fin: int, fout: int) -> bool:
    try:
        fcntl.ioctl(fout, FICLONE, fin)
    except OSError:
        return False
    return True


def _copy_data(fin: int, fout: int, size: int) -> None:
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fin, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: only a hole remains
                raise
            break
        end = os.lseek(fin, start, os.SEEK_HOLE)
        _copy_range(fin, fout, start, end)
        pos = end
    os.ftruncate(fout, size)


def _copy_range(fin: int, fout: int, start: int, end: int) -> None:
    while start < end:
        try:
            n = os.copy_file_range(fin, fout, end - start, start, start)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            n = os.pwrite(fout, os.pread(fin, min(end - start, 1 << 20), start), start)
        if n == 0:
            break
        start += n


# ---------------------------------------------------------------------------------------- mount


def overlay_mount(target: Path, lowers: list[Path], upper: Path | None, work: Path | None) -> None:
    """Mount an overlay of ``lowers`` (newest first) and, unless None (a read-only view),
    ``upper``/``work`` on ``target``.

    The option string must fit one page (mount(2) truncates the rest without an error), so lowers
    are passed relative to the directory most of them share, with ``mount`` running there: a
    store layer then costs 18 bytes instead of its absolute path."""
    if not lowers:
        raise LayerError("an overlay needs at least one lower directory")
    if (upper is None) != (work is None):
        raise LayerError("an overlay upper directory needs a work directory and vice versa")
    if len(lowers) > KERNEL_MAX_LOWERS:
        raise LayerError(f"{len(lowers)} lower directories: overlayfs takes at most {KERNEL_MAX_LOWERS}")
    absolute = [Path(os.path.abspath(p)) for p in lowers]
    for path in absolute:
        if not path.is_dir():
            raise LayerError(f"overlay lower directory {path} does not exist")
    if upper is None and len(absolute) == 1:
        _mount(["--bind", "-o", "ro", str(absolute[0]), str(target)], cwd=None)
        return
    cwd, lowerdir = _lowerdir(absolute)
    options = _options(lowerdir, upper, work)
    _mount(["-t", "overlay", "overlay", "-o", options, str(target)], cwd=cwd)


def _lowerdir(lowers: list[Path]) -> tuple[Path, str]:
    """``lowerdir=`` value relative to the most common parent, and that parent."""
    cwd = Counter(p.parent for p in lowers).most_common(1)[0][0]
    parts = [p.name if p.parent == cwd else str(p) for p in lowers]
    for path, part in zip(lowers, parts, strict=True):
        _check_option_path(path, part)
    return cwd, ":".join(parts)


def _options(lowerdir: str, upper: Path | None, work: Path | None) -> str:
    opts = [f"lowerdir={lowerdir}"]
    if upper is not None and work is not None:
        for path in (upper, work):
            _check_option_path(path, str(path))
        opts += [f"upperdir={os.path.abspath(upper)}", f"workdir={os.path.abspath(work)}"]
    opts.append(OVERLAY_OPTIONS)
    options = ",".join(opts)
    if len(options.encode()) > MOUNT_DATA_MAX:
        raise LayerError(
            f"overlay options are {len(options.encode())} bytes, mount(2) takes {MOUNT_DATA_MAX}: "
            "squash the layer chain (or shorten the data directory path)"
        )
    return options


def _check_option_path(path: Path, text: str) -> None:
    """mount(8) splits options at commas and overlayfs lowerdir at colons: refuse, don't guess."""
    if any(c in text for c in _FORBIDDEN_IN_PATHS):
        raise LayerError(f"overlay directory {path} contains one of , : \\ or a newline")


def _mount(args: list[str], cwd: Path | None) -> None:
    """mount(2) from this process (``args`` as mount(8) would take them: ``--bind -o ro SRC DST`` or
    ``-t overlay overlay -o OPTIONS DST``); a process per mount cost ~4 ms of CPU."""
    try:
        if args[0] == "--bind":
            source, target = args[-2], args[-1]
            mounts.mount(source, target, None, mounts.MS_BIND)
            # A bind mount takes its flags only when remounted (what mount(8) does for ``-o ro``).
            mounts.mount("none", target, None, mounts.MS_BIND | mounts.MS_REMOUNT | mounts.MS_RDONLY)
        else:
            mounts.mount_in(cwd, args[2], Path(args[-1]), args[1], 0, args[4])
    except OSError as exc:
        raise LayerError(f"mount {' '.join(args)} failed: {exc.strerror or exc}") from exc


def overlay_unmount(target: Path, *, busy_timeout: float = 2.0) -> None:
    """Unmount ``target`` if it is mounted. While it is busy (a killed sandbox's gofer still
    exiting) the unmount is retried for ``busy_timeout`` seconds, then done lazily.

    A lazily detached overlay lives on until its last open file closes and keeps its upper in
    use: adopting that upper then makes a layer something may still write to (the kernel logs
    "lowerdir is in-use as upperdir/workdir of another mount" when it is next mounted)."""
    deadline = time.monotonic() + busy_timeout
    delay = 0.02
    failure: OSError | None = None
    while _is_mountpoint(target):
        try:
            mounts.umount(target)
            return
        except OSError as exc:
            failure = exc
        if not _is_mountpoint(target):
            return
        if failure.errno != errno.EBUSY or time.monotonic() + delay > deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
    else:
        return
    log.warning("%s is busy (%s): unmounting it lazily", target, failure)
    try:
        mounts.umount(target, mounts.MNT_DETACH)
    except OSError as lazy:
        if _is_mountpoint(target):
            raise LayerError(f"umount {target} failed: {failure}; lazily: {lazy}") from lazy


def _is_mountpoint(path: Path) -> bool:
    """From mountinfo: ``os.path.ismount`` misses bind mounts within one file system."""
    wanted = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(_unescape_mountinfo(line.split(" ", 5)[4]) == wanted for line in f)


__all__ = [
    "KERNEL_MAX_LOWERS",
    "LAYER_ID_PREFIX",
    "MAX_LOWERS",
    "LayerError",
    "LayerStore",
    "overlay_mount",
    "overlay_unmount",
    "tree_bytes",
]
