"""mount(2), umount2(2), loop devices and per-thread kernel state from this process, without a
``mount``/``umount``/``ip`` process per call.

Creates, restores and kills of sandboxes mount and unmount their disks and root overlays, often
sixteen at once (a fork): a ``mount`` process costs ~4 ms of host CPU here against ~0.1 ms for the
system call. What mount(8) adds is done here the way it does it: a loop device for an image file
(``LOOP_CTL_GET_FREE``, ``LOOP_CONFIGURE`` with autoclear, retried when another process takes the
device first), and paths relative to a working directory (overlayfs resolves ``lowerdir`` against
the caller's cwd) from a thread of its own.

:func:`in_fresh_thread` runs a function in a new thread that ends with it: state the kernel keeps
per thread once unshared (the working directory after ``unshare(CLONE_FS)``, the network namespace
after ``setns``/``unshare(CLONE_NEWNET)``) cannot leak into the server's other threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

MS_RDONLY = 0x1
MS_NOATIME = 0x400
MS_BIND = 0x1000
MS_REMOUNT = 0x20
MS_REC = 0x4000
MS_SHARED = 0x100000
MNT_DETACH = 0x2
CLONE_FS = 0x200
CLONE_NEWNET = 0x40000000
LOOP_CONTROL = "/dev/loop-control"
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
#: Tries at a free loop device (another process may configure the one we were given first).
LOOP_TRIES = 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(
    source: str, target: str | Path, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    """mount(2); raises OSError with the errno."""
    _check(
        _libc.mount(
            source.encode(),
            str(target).encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def umount(target: str | Path, flags: int = 0) -> None:
    """umount2(2); raises OSError with the errno (EBUSY, EINVAL: not a mount point, ...)."""
    _check(_libc.umount2(str(target).encode(), flags), f"umount {target}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a new thread that ends when it returns (see the module docstring)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=body, name="forkyard-fresh", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def mount_in(cwd: Path | None, source: str, target: Path, fstype: str, flags: int, data: str) -> None:
    """mount(2) with relative paths in ``data`` resolved against ``cwd`` (the server's own working
    directory stays as it is: a thread of its own, unshared)."""
    if cwd is None:
        mount(source, target, fstype, flags, data)
        return

    where = os.path.abspath(target)

    def in_cwd() -> None:
        unshare(CLONE_FS)
        os.chdir(cwd)
        mount(source, where, fstype, flags, data)

    in_fresh_thread(in_cwd)


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


def _attach_loop(image_fd: int, name: bytes) -> tuple[int, str]:
    """An open fd and the path of a free loop device now backed by ``image_fd``, with autoclear:
    the device is freed when its last user (this fd, then the mount) lets go."""
    config = _LoopConfig()
    config.fd = image_fd
    config.info.lo_flags = LO_FLAGS_AUTOCLEAR
    ctypes.memmove(config.info.lo_file_name, name[:63], min(len(name), 63))
    control = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(LOOP_TRIES):
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            path = f"/dev/loop{number}"
            try:
                device = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # udev has not made the node yet; the kernel has the device
                with contextlib.suppress(FileExistsError):
                    os.mknod(path, 0o660 | 0o060000, os.makedev(7, number))
                device = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(device, LOOP_CONFIGURE, bytes(config))
                return device, path
            except OSError as exc:
                os.close(device)
                if exc.errno != errno.EBUSY:  # EBUSY: another process configured it first
                    raise
        raise OSError(errno.EBUSY, f"no free loop device after {LOOP_TRIES} tries")
    finally:
        os.close(control)


def mount_image(image: Path, target: Path, fstype: str, flags: int = 0, data: str | None = None) -> None:
    """Mount the file system in the file ``image`` on ``target`` through a loop device (what
    ``mount -o loop`` does); the loop device goes away with the unmount."""
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        device, path = _attach_loop(image_fd, os.fsencode(os.path.abspath(image)))
    finally:
        os.close(image_fd)
    try:
        mount(path, target, fstype, flags, data)
    finally:
        with contextlib.suppress(OSError):
            os.close(device)
