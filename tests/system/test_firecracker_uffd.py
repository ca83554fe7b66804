"""The userfaultfd page server, with this test playing Firecracker's part for real: it creates
and registers a userfaultfd over an anonymous mapping, hands it to the handler process over the
Unix socket exactly as Firecracker does, then touches the memory."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from forkyard.runtime.firecracker.uffd import uffd_api, uffd_register, userfaultfd

PAGE = 4096
PAGES = 64


def _userfaultfd_or_skip() -> int:
    try:
        return userfaultfd()
    except OSError as exc:
        pytest.skip(f"userfaultfd unavailable here: {exc} (needs root or vm.unprivileged_userfaultfd=1)")


def test_handler_serves_pages_from_the_snapshot_memory_file(tmp_path: Path) -> None:
    memory = tmp_path / "memory.bin"
    memory.write_bytes(b"".join(bytes([i]) * PAGE for i in range(PAGES)))
    uffd = _userfaultfd_or_skip()
    region = mmap.mmap(-1, PAGES * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    uffd_api(uffd)
    uffd_register(uffd, base, PAGES * PAGE)

    sock = Path("/tmp") / f"aeuffd-{uuid.uuid4().hex[:8]}.sock"
    handler = subprocess.Popen(
        [sys.executable, "-m", "forkyard.runtime.firecracker.uffd", str(sock), str(memory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert handler.stdout is not None and handler.stdout.readline().strip() == "ready"
        vmm = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        vmm.connect(str(sock))
        # Firecracker's message: the regions as JSON, the userfaultfd as SCM_RIGHTS.
        mappings = [{"base_host_virt_addr": base, "size": PAGES * PAGE, "offset": 0, "page_size": PAGE}]
        vmm.sendmsg(
            [json.dumps(mappings).encode()],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, memoryview(bytearray(uffd.to_bytes(4, "little"))))],
        )
        # First touches fault; each blocks until the handler has UFFDIO_COPY-ed the page in.
        for page in (0, 7, 63, 7):
            assert region[page * PAGE : page * PAGE + 8] == bytes([page]) * 8
        assert region[5 * PAGE + 100] == 5
        vmm.close()  # the VMM exits: the handler must notice and stop
        _, err = handler.communicate(timeout=10)
        assert handler.returncode == 0, err
        assert "served 4 pages" in err
    finally:
        if handler.poll() is None:
            handler.kill()
            handler.wait()
        sock.unlink(missing_ok=True)
        os.close(uffd)


def test_handler_rejects_a_connection_without_a_userfaultfd(tmp_path: Path) -> None:
    memory = tmp_path / "memory.bin"
    memory.write_bytes(b"\0" * PAGE)
    sock = Path("/tmp") / f"aeuffd-{uuid.uuid4().hex[:8]}.sock"
    handler = subprocess.Popen(
        [sys.executable, "-m", "forkyard.runtime.firecracker.uffd", str(sock), str(memory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert handler.stdout is not None and handler.stdout.readline().strip() == "ready"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as vmm:
            vmm.connect(str(sock))
            vmm.sendall(b"[]")
            time.sleep(0.05)
        _, err = handler.communicate(timeout=10)
        assert handler.returncode != 0
        assert "sent no userfaultfd" in err
    finally:
        if handler.poll() is None:
            handler.kill()
            handler.wait()
        sock.unlink(missing_ok=True)
