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
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from agentenv.storage.layers import OPAQUE_XATTR

#: relative path -> [inode, ctime in ns] of one upper entry.
Entries = dict[str, list[int]]


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


def build(upper: Path, dest: Path, before: Entries) -> Entries:
    """Write into the new directory ``dest`` the layer that turns the view of the chain recorded
    with ``before`` into the upper's view now; return the upper's entries now. Nothing may write
    to the upper meanwhile (the sandbox is paused)."""
    now = scan(upper)
    dest.mkdir()
    _copy_meta(upper, dest, keep_opaque=False)
    copier = _Copier(upper, dest, before)
    for rel in sorted(now):  # a parent sorts before its children
        if now[rel] != before.get(rel):
            copier.copy(rel)
    for rel in sorted(set(before) - set(now)):
        if all(parent in now for parent in _parents(rel)):  # else an ancestor's whiteout covers it
            copier.whiteout(rel)
    return now


class _Copier:
    def __init__(self, upper: Path, dest: Path, before: Entries) -> None:
        self.upper, self.dest, self.before = upper, dest, before
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
