"""A userfaultfd page-fault handler for Firecracker's ``Uffd`` memory backend.

With ``mem_backend: {backend_type: Uffd, backend_path: <socket>}`` Firecracker maps guest memory
anonymously, registers it with a userfaultfd and connects to ``<socket>``, sending in one message
the JSON list of guest regions (``base_host_virt_addr``, ``size``, ``offset``, ``page_size``, or
``page_size_kib``, in bytes too, in older releases) and the userfaultfd itself as SCM_RIGHTS.
From then on every first touch of a guest page is a fault this handler resolves with ``UFFDIO_COPY`` from the
snapshot's memory file, so a restore starts without reading the memory file up front.
Pages the balloon gave back (``UFFD_EVENT_REMOVE``) are served as zero pages afterwards.

Run one handler per restored VM: ``python -m forkyard.runtime.firecracker.uffd SOCKET MEMORY``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path


def _iowr(nr: int, size: int) -> int:
    """``_IOWR(UFFDIO, nr, size)`` with UFFDIO = 0xAA."""
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


UFFDIO_REGISTER = _iowr(0x00, 32)
UFFDIO_COPY = _iowr(0x03, 40)
UFFDIO_ZEROPAGE = _iowr(0x04, 32)
UFFDIO_API = _iowr(0x3F, 24)
UFFD_API = 0xAA
UFFDIO_REGISTER_MODE_MISSING = 1
UFFD_FEATURE_EVENT_REMOVE = 1 << 3
UFFD_EVENT_PAGEFAULT = 0x12
UFFD_EVENT_REMOVE = 0x15
UFFD_MSG_SIZE = 32
SYS_USERFAULTFD = 323  # x86_64


@dataclass(frozen=True)
class GuestRegion:
    base: int
    size: int
    offset: int
    page_size: int

    @classmethod
    def from_json(cls, item: dict[str, int]) -> GuestRegion:
        # ``page_size_kib`` is in bytes despite its name (Firecracker's own comment; deprecated).
        page_size = item["page_size"] if "page_size" in item else item["page_size_kib"]
        return cls(item["base_host_virt_addr"], item["size"], item["offset"], page_size)

    def contains(self, address: int) -> bool:
        return self.base <= address < self.base + self.size


def userfaultfd(flags: int = os.O_CLOEXEC | os.O_NONBLOCK) -> int:
    """A new userfaultfd (what Firecracker creates; used here by tests playing its part)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(SYS_USERFAULTFD, flags))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"userfaultfd: {os.strerror(err)}")
    return fd


def uffd_api(fd: int, features: int = UFFD_FEATURE_EVENT_REMOVE) -> None:
    fcntl.ioctl(fd, UFFDIO_API, bytearray(struct.pack("QQQ", UFFD_API, features, 0)), True)


def uffd_register(fd: int, start: int, length: int) -> None:
    buf = bytearray(struct.pack("QQQQ", start, length, UFFDIO_REGISTER_MODE_MISSING, 0))
    fcntl.ioctl(fd, UFFDIO_REGISTER, buf, True)


class PageServer:
    """Resolves the faults of one VM's guest memory from one memory file."""

    def __init__(self, uffd: int, regions: list[GuestRegion], memory_file: Path) -> None:
        self.uffd = uffd
        self.regions = regions
        self.page_size = regions[0].page_size
        fd = os.open(memory_file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            # MAP_PRIVATE + PROT_WRITE only so ctypes can take the buffer's address; never written.
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.removed: set[int] = set()
        self.served = 0

    def _region(self, address: int) -> GuestRegion:
        for region in self.regions:
            if region.contains(address):
                return region
        raise ValueError(f"fault at {address:#x} is outside every guest region")

    def handle_fault(self, address: int) -> bool:
        page = address & ~(self.page_size - 1)
        if page // self.page_size in self.removed:
            return self._ioctl_retry(UFFDIO_ZEROPAGE, struct.pack("QQQq", page, self.page_size, 0, 0))
        region = self._region(page)
        src = self._base + region.offset + (page - region.base)
        ok = self._ioctl_retry(UFFDIO_COPY, struct.pack("QQQQq", page, src, self.page_size, 0, 0))
        if ok:
            self.served += 1
        return ok

    def handle_remove(self, start: int, end: int) -> None:
        self.removed.update(range(start // self.page_size, end // self.page_size))

    def _ioctl_retry(self, request: int, payload: bytes) -> bool:
        """False on EAGAIN (a REMOVE raced the fault: the fault will be delivered again)."""
        try:
            fcntl.ioctl(self.uffd, request, bytearray(payload), True)
        except OSError as exc:
            if exc.errno == errno.EEXIST:  # another thread's fault already populated the page
                return True
            if exc.errno == errno.EAGAIN:
                return False
            raise
        return True

    def serve_forever(self, vmm: socket.socket) -> None:
        """Handle events until the VMM goes away: its end of ``vmm`` closes when it exits."""
        poller = select.poll()
        poller.register(self.uffd, select.POLLIN)
        poller.register(vmm.fileno(), select.POLLIN)
        while True:
            for fd, mask in poller.poll():
                if fd == vmm.fileno():
                    # Newer VMMs may send further messages (guest_memfd fault requests, unused
                    # with a File-backed snapshot); EOF or an error means the VMM is gone.
                    try:
                        if not vmm.recv(65536):
                            return
                    except OSError:
                        return
                elif mask & (select.POLLHUP | select.POLLERR):
                    return
                else:
                    self._drain()

    def _drain(self) -> None:
        while True:
            try:
                msg = os.read(self.uffd, UFFD_MSG_SIZE)
            except BlockingIOError:
                return
            if len(msg) < UFFD_MSG_SIZE:
                return
            event = msg[0]
            if event == UFFD_EVENT_PAGEFAULT:
                _flags, address = struct.unpack_from("QQ", msg, 8)
                self.handle_fault(address)
            elif event == UFFD_EVENT_REMOVE:
                start, end = struct.unpack_from("QQ", msg, 8)
                self.handle_remove(start, end)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.uffd)


def accept_vmm(listener: socket.socket) -> tuple[socket.socket, int, list[GuestRegion]]:
    """Accept Firecracker's connection; return it (kept open), its userfaultfd and regions."""
    conn, _ = listener.accept()
    try:
        fds: list[int] = []
        data = b""
        for _ in range(5):  # Firecracker sends one message; tolerate it arriving split
            chunk, ancdata, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
            data += chunk
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
            if fds and data:
                break
        if not fds:
            raise RuntimeError(f"the VMM sent no userfaultfd (message: {data[:200]!r})")
        for extra in fds[1:]:
            os.close(extra)
        regions = [GuestRegion.from_json(item) for item in json.loads(data.decode())]
    except BaseException:
        conn.close()
        raise
    return conn, fds[0], regions


def serve(socket_path: Path, memory_file: Path) -> int:
    """Listen on ``socket_path``, serve one VMM's faults from ``memory_file``; pages served."""
    socket_path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(socket_path))
        listener.listen(1)
        print("ready", flush=True)  # the runtime waits for this before sending /snapshot/load
        conn, uffd, regions = accept_vmm(listener)
    socket_path.unlink(missing_ok=True)
    server = PageServer(uffd, regions, memory_file)
    try:
        with conn:
            server.serve_forever(conn)
    finally:
        server.close()
    return server.served


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", type=Path)
    parser.add_argument("memory", type=Path)
    args = parser.parse_args(argv)
    served = serve(args.socket, args.memory)
    print(f"served {served} pages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
