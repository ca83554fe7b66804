"""``EntryInfo`` for a path, the way Go's envd fills it (os.Lstat + FileMode.String())."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from collections.abc import Callable

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from forkyard.envd.filesystem.metadata_store import default_store
from forkyard.envd.proto.filesystem_pb import EntryInfo, FileType

#: User metadata lives in this xattr namespace (envd.yaml ``POST /files``); the prefix is stripped.
METADATA_XATTR_PREFIX = "user.e2b."

# Go's FileMode.String() type letters, in bit order (os/types.go).
_GO_MODE_LETTERS = (
    (stat.S_IFDIR, "d"),
    (stat.S_IFLNK, "L"),
    (stat.S_IFBLK, "D"),
    (stat.S_IFIFO, "p"),
    (stat.S_IFSOCK, "S"),
)


def go_mode_string(mode: int) -> str:
    """``-rw-r--r--`` / ``drwxr-xr-x`` / ``Lrwxrwxrwx``, as envd's Go ``FileMode.String()`` prints."""
    prefix = ""
    fmt = stat.S_IFMT(mode)
    for bits, letter in _GO_MODE_LETTERS:
        if fmt == bits:
            prefix += letter
    if fmt == stat.S_IFCHR:
        prefix += "Dc"
    if mode & stat.S_ISUID:
        prefix += "u"
    if mode & stat.S_ISGID:
        prefix += "g"
    if mode & stat.S_ISVTX:
        prefix += "t"
    rwx = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (prefix or "-") + rwx


# Every lookup parses /etc/passwd or /etc/group again; a listing asks for the same few ids over and
# over. Only names found are kept, so an account created later still shows up.
_OWNER_NAMES: dict[int, str] = {}
_GROUP_NAMES: dict[int, str] = {}


def _account_name(cache: dict[int, str], number: int, lookup: Callable[[int], str]) -> str:
    """The name of a uid or gid; the number itself when no account has it (as Go's envd prints)."""
    if number not in cache:
        try:
            cache[number] = lookup(number)
        except KeyError:
            return str(number)
    return cache[number]


def _owner(uid: int) -> str:
    return _account_name(_OWNER_NAMES, uid, lambda n: pwd.getpwuid(n).pw_name)


def _group(gid: int) -> str:
    return _account_name(_GROUP_NAMES, gid, lambda n: grp.getgrgid(n).gr_name)


def _file_type(mode: int) -> FileType:
    if stat.S_ISLNK(mode):
        return FileType.SYMLINK
    if stat.S_ISDIR(mode):
        return FileType.DIRECTORY
    return FileType.FILE


def read_metadata(path: str) -> dict[str, str]:
    """``user.e2b.*`` xattrs, or what the metadata store keeps where the file system has no
    user xattrs (gVisor's gofer: metadata_store.py)."""
    stored = default_store().get(path)
    if stored is not None:
        return stored
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    metadata: dict[str, str] = {}
    for name in names:
        if not name.startswith(METADATA_XATTR_PREFIX):
            continue
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        metadata[name.removeprefix(METADATA_XATTR_PREFIX)] = value.decode("utf-8", "replace")
    return metadata


def entry_from_stat(path: str, st: os.stat_result) -> EntryInfo:
    entry = EntryInfo(
        name=os.path.basename(path) or path,
        type=_file_type(st.st_mode),
        path=path,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode) & 0o777,
        permissions=go_mode_string(st.st_mode),
        owner=_owner(st.st_uid),
        group=_group(st.st_gid),
        modified_time=Timestamp.from_nanos(st.st_mtime_ns),
        metadata=read_metadata(path),
    )
    if stat.S_ISLNK(st.st_mode):
        # Go's envd reports filepath.EvalSymlinks (the fully resolved target) and the type of
        # what the link points to; a dangling link keeps the symlink type.
        entry.symlink_target = os.path.realpath(path)
        try:
            entry.type = _file_type(os.stat(path).st_mode)
        except OSError:
            pass
    return entry


def entry_info(path: str) -> EntryInfo:
    """EntryInfo of ``path`` itself (a symlink is described, not followed); raises ConnectError."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None
    return entry_from_stat(path, st)


def os_error_to_connect(exc: OSError, path: str) -> ConnectError:
    """Map an OSError to the Connect code the SDK branches on (NOT_FOUND, ALREADY_EXISTS, ...)."""
    code = {
        errno.ENOENT: Code.NOT_FOUND,
        errno.ENOTDIR: Code.INVALID_ARGUMENT,
        errno.EISDIR: Code.INVALID_ARGUMENT,
        errno.EEXIST: Code.ALREADY_EXISTS,
        errno.ENOTEMPTY: Code.FAILED_PRECONDITION,
        errno.EACCES: Code.PERMISSION_DENIED,
        errno.EPERM: Code.PERMISSION_DENIED,
        errno.EROFS: Code.PERMISSION_DENIED,
        errno.ENOSPC: Code.RESOURCE_EXHAUSTED,
        errno.ENAMETOOLONG: Code.INVALID_ARGUMENT,
    }.get(exc.errno or 0, Code.INTERNAL)
    if code is Code.NOT_FOUND:
        return ConnectError(code, f"path '{path}' does not exist")
    return ConnectError(code, f"'{path}': {exc.strerror or exc}")
