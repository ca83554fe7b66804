"""Network namespaces, veth links, addresses and routes from this process: netlink through
pyroute2, and the namespace's own system calls, where each sandbox's set-up and tear-down started
``ip`` processes (two or three per child of a fork, ~2.4 ms of host CPU each here).

A named network namespace is what ``ip netns add`` makes: a new namespace bind-mounted on
``/var/run/netns/<name>`` (that directory a shared mount point, so the name is seen in every
mount namespace). The namespace is unshared by a thread of its own that ends right after
(:func:`forkyard.storage.mounts.in_fresh_thread`), and what is done inside a namespace runs in
such a thread that entered it (``setns``): the kernel keeps the network namespace per thread, so
none of the server's other threads ever changes namespace. pyroute2's own namespace support forks
the whole process instead (a copy of the server's page tables per call).

Interfaces are found by name with ``if_nametoindex`` (an ioctl in the calling thread's namespace),
not with a netlink dump: pyroute2 decodes every link of a dump in Python (~0.25 ms per message
here), and a node's host namespace holds a veth per sandbox.

Every function here blocks (netlink is fast, but the kernel may wait for an RTNL lock): call them
off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from forkyard.storage import mounts

T = TypeVar("T")

NETNS_DIR = Path("/var/run/netns")


class LinkExists(Exception):
    """The host side's interface name is taken (another data directory's sandbox has it)."""


def _share_netns_dir() -> None:
    """Make ``NETNS_DIR`` a shared mount point, as ``ip netns add`` does (bound onto itself first
    when it is not a mount point yet)."""
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    try:
        mounts.mount("none", NETNS_DIR, None, mounts.MS_SHARED | mounts.MS_REC)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        mounts.mount(str(NETNS_DIR), NETNS_DIR, None, mounts.MS_BIND | mounts.MS_REC)
        mounts.mount("none", NETNS_DIR, None, mounts.MS_SHARED | mounts.MS_REC)


def create_netns(name: str) -> None:
    """A new network namespace named ``name``; FileExistsError when the name is taken (then
    nothing was made)."""
    _share_netns_dir()
    path = NETNS_DIR / name
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))

    def unshared() -> None:
        mounts.unshare(mounts.CLONE_NEWNET)
        mounts.mount("/proc/thread-self/ns/net", path, None, mounts.MS_BIND)

    try:
        mounts.in_fresh_thread(unshared)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def delete_netns(name: str) -> None:
    """Remove the name of a network namespace (as ``ip netns del``: the namespace itself goes when
    nothing else holds it, its interfaces with it). Idempotent."""
    path = NETNS_DIR / name
    with contextlib.suppress(OSError):  # EINVAL: not mounted (half made), ENOENT: gone
        mounts.umount(path, mounts.MNT_DETACH)
    path.unlink(missing_ok=True)


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` in a thread that entered the network namespace ``name``."""
    path = NETNS_DIR / name

    def entered() -> T:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mounts.setns(fd, mounts.CLONE_NEWNET)
        finally:
            os.close(fd)
        return fn()

    return mounts.in_fresh_thread(entered)


def add_veth(host_if: str, sandbox_if: str, netns: str, host_ip: str, prefixlen: int) -> None:
    """A veth pair: ``host_if`` on the host with ``host_ip``, up; ``sandbox_if`` in ``netns``.
    LinkExists when ``host_if`` is taken (nothing was made); other failures leave what was made
    for the caller's tear-down."""
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with IPRoute() as ipr:
            try:
                ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": sandbox_if, "net_ns_fd": fd})
            except NetlinkError as exc:
                if exc.code == errno.EEXIST:
                    raise LinkExists(host_if) from exc
                raise
            index = socket.if_nametoindex(host_if)
            ipr.addr("add", index=index, address=host_ip, prefixlen=prefixlen)
            ipr.link("set", index=index, state="up")
    finally:
        os.close(fd)


def address_sandbox_side(
    netns: str, sandbox_if: str, sandbox_ip: str, prefixlen: int, gateway: str, *, replace: bool
) -> None:
    """In ``netns``: ``sandbox_ip`` on ``sandbox_if``, it and ``lo`` up, the default route via
    ``gateway``. ``replace`` (a link whose address runsc took off) replaces what is there."""

    def configure() -> None:
        with IPRoute() as ipr:
            index = socket.if_nametoindex(sandbox_if)
            verb = "replace" if replace else "add"
            ipr.addr(verb, index=index, address=sandbox_ip, prefixlen=prefixlen)
            if not replace:
                ipr.link("set", index=index, state="up")
                ipr.link("set", index=socket.if_nametoindex("lo"), state="up")
            ipr.route(verb, dst="0.0.0.0/0", gateway=gateway, oif=index)

    in_netns(netns, configure)


def delete_link(name: str) -> None:
    """Delete the interface ``name`` (a veth: both ends). Idempotent."""
    with IPRoute() as ipr:
        try:
            ipr.link("del", ifname=name)
        except NetlinkError as exc:
            if exc.code not in (errno.ENODEV, errno.ENOENT):
                raise
