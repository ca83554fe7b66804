"""The layer a snapshot of a *running* gVisor sandbox adds: what its overlay upper changed since
the previous running snapshot (the whole upper after a new mount).

A running sandbox keeps writing to its upper, so the upper cannot become a layer by a rename as
at a stopping snapshot; it is copied instead, and only in part. The sandbox's manifest records
each upper entry's (inode, ctime) at the last running snapshot, together with that snapshot's
chain. The next one copies what is new or changed (a write, chmod, chown or rename moves the
ctime), turns what disappeared into whiteouts, and stacks the result on that chain: incremental
like a sealed upper. A new mount (a stopping snapshot sealed the upper, a resume) changes the
sandbox's chain and so voids the manifest: the next copy is whole.

Opaque markers: an upper directory is opaque over the sandbox's *mounted* chain. A directory the
previous copy already had (same inode) is copied without the marker, so that the previous layers'
entries below it still show; a new directory keeps it.

Pre-copy: the copy is made while the sandbox is paused, so its data is time the sandbox is
unavailable (100 MiB: ~40 ms here). :func:`precopy` copies the large changed files *before* the
pause, while the sandbox runs; :func:`build` then links each one whose file has not changed since
(same inode, ctime, mtime and size) instead of copying it again. A change is always seen:
``write``, ``truncate``, ``rename``, ``chmod`` and the sentry's flush of its cached writes move the
ctime, and so does the first write through each *new* shared mapping (``page_mkwrite``); the
ctime comes from a clock that can lag by a tick, so a file changed less than
:data:`SETTLED_NS` before its pre-copy is not pre-copied. What the ctime does not show is a write
through a mapping that already existed, with its pages already writable: a file mapped by any
process of the sandbox when it is pre-copied or when the snapshot is taken is copied in the pause.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from forkyard.storage.layers import OPAQUE_XATTR

#: relative path -> [inode, ctime in ns] of one upper entry.
Entries = dict[str, list[int]]
#: Files smaller than this are copied in the pause only (a link saves nothing on them).
PRECOPY_MIN_BYTES = 64 << 10
#: A file is pre-copied only if its ctime is this much older than the pre-copy: a write right
#: after it may carry the same coarse timestamp (one scheduler tick) as the one before.
SETTLED_NS = 50_000_000


@dataclass(frozen=True)
class Staged:
    """A file copied before the pause, and the state of the upper's file it copied."""

    path: Path
    key: tuple[int, int, int, int]


def _key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size)


def precopy(upper: Path, staging: Path, before: Entries, mapped: set[int]) -> dict[str, Staged]:
    """Copy into the new directory ``staging`` the large regular files the next :func:`build`
    would copy, while the sandbox runs; ``mapped``: inodes any process of the sandbox maps now."""
    staging.mkdir()
    staged: dict[str, Staged] = {}
    for rel, (ino, ctime_ns) in scan(upper).items():
        if [ino, ctime_ns] == before.get(rel) or ino in mapped:
            continue
        src = upper / rel
        started = time.time_ns()
        try:
            st = os.lstat(src)
            if not stat.S_ISREG(st.st_mode) or st.st_size < PRECOPY_MIN_BYTES:
                continue
            if st.st_ctime_ns > started - SETTLED_NS:
                continue  # just written: maybe still being written
            dst = staging / str(len(staged))
            shutil.copyfile(src, dst, follow_symlinks=False)
            if _key(os.lstat(src)) != _key(st):
                continue  # changed while it was copied
        except FileNotFoundError:
            continue  # removed meanwhile: the pause's copy sees it gone
        staged[rel] = Staged(dst, _key(st))
    return staged


def scan(upper: Path) -> Entries:
    """Every entry below ``upper`` (not the root itself)."""
    entries: Entries = {}
    todo = [""]
    while todo:
        rel_dir = todo.pop()
        with os.scandir(upper / rel_dir) as it:
            for entry in it:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                st = entry.stat(follow_symlinks=False)
                entries[rel] = [st.st_ino, st.st_ctime_ns]
                if stat.S_ISDIR(st.st_mode):
                    todo.append(rel)
    return entries


def build(
    upper: Path,
    dest: Path,
    before: Entries,
    staged: dict[str, Staged] | None = None,
    mapped: set[int] | None = None,
) -> Entries:
    """Write into the new directory ``dest`` the layer that turns the view of the chain recorded
    with ``before`` into the upper's view now; return the upper's entries now. Nothing may write
    to the upper meanwhile (the sandbox is paused). ``staged``: files :func:`precopy` copied,
    linked where the upper's file is unchanged and not in ``mapped`` (inodes mapped now)."""
    now = scan(upper)
    dest.mkdir()
    _copy_meta(upper, dest, keep_opaque=False)
    copier = _Copier(upper, dest, before, staged or {}, mapped or set())
    for rel in sorted(now):  # a parent sorts before its children
        if now[rel] != before.get(rel):
            copier.copy(rel)
    for rel in sorted(set(before) - set(now)):
        if all(parent in now for parent in _parents(rel)):  # else an ancestor's whiteout covers it
            copier.whiteout(rel)
    return now


class _Copier:
    def __init__(
        self, upper: Path, dest: Path, before: Entries, staged: dict[str, Staged], mapped: set[int]
    ) -> None:
        self.upper, self.dest, self.before = upper, dest, before
        self.staged, self.mapped = staged, mapped
        #: inode -> its first copy: hard links in the upper stay hard links in the layer.
        self._linked: dict[int, Path] = {}

    def copy(self, rel: str) -> None:
        self._parents_of(rel)
        src, dst = self.upper / rel, self.dest / rel
        st = os.lstat(src)
        if stat.S_ISDIR(st.st_mode):
            if not dst.is_dir():
                os.mkdir(dst)
            _copy_meta(src, dst, keep_opaque=self._is_new(rel, st))
        elif st.st_nlink > 1 and st.st_ino in self._linked:
            os.link(self._linked[st.st_ino], dst)
        else:
            staged = self.staged.get(rel)
            if staged is not None and staged.key == _key(st) and st.st_ino not in self.mapped:
                os.link(staged.path, dst)
            else:
                _copy_node(src, dst, st)
            _copy_meta(src, dst, keep_opaque=False)
            self._linked[st.st_ino] = dst

    def whiteout(self, rel: str) -> None:
        self._parents_of(rel)
        os.mknod(self.dest / rel, stat.S_IFCHR | 0o600, os.makedev(0, 0))

    def _parents_of(self, rel: str) -> None:
        """The directories above ``rel`` (unchanged ones too: a layer needs its parents)."""
        for parent in _parents(rel):
            if not (self.dest / parent).is_dir():
                self.copy(parent)

    def _is_new(self, rel: str, st: os.stat_result) -> bool:
        known = self.before.get(rel)
        return known is None or known[0] != st.st_ino


def _parents(rel: str) -> list[str]:
    """``a/b/c`` -> ``["a", "a/b"]``."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _copy_node(src: Path, dst: Path, st: os.stat_result) -> None:
    if stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    else:  # whiteouts (0/0 character devices), other devices, FIFOs, sockets
        os.mknod(dst, st.st_mode, st.st_rdev)


def _copy_meta(src: Path, dst: Path, *, keep_opaque: bool) -> None:
    """Owner, mode, xattrs, then times (every other change would move them)."""
    st = os.lstat(src)
    os.lchown(dst, st.st_uid, st.st_gid)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if name != OPAQUE_XATTR or keep_opaque:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
