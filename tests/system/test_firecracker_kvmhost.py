"""Real Firecracker microVMs through the official e2b SDK, on an emulated KVM host.

One outer QEMU guest per test module (:mod:`tests.support.kvmhost`: TCG with AMD SVM, Debian's
kernel with kvm_amd, ``forkyard serve`` with ``FORKYARD_RUNTIME=firecracker`` inside, its port
forwarded here). Everything inside runs on one emulated CPU: a microVM boot takes minutes, a
command seconds, so the tests are few and each covers a whole path. They skip, printing why, where
the host cannot be emulated (not root, no QEMU, no EPYC model, no base template).

The tests run in file order and share the host; each leaves no sandbox behind.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from e2b import CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.network import ALL_TRAFFIC

from tests.support.counter import assert_state_continues, start_state
from tests.support.kvmhost import (
    DISK_MB,
    PAUSE_DISK_AFTER_S,
    KvmHost,
    KvmHostUnavailable,
    ProbeHosts,
    unavailable_reason,
)

pytestmark = [pytest.mark.requires_root("the emulated KVM host (QEMU, 9p export of /)"), pytest.mark.slow]

#: Seconds an SDK request may take: every guest instruction is emulated twice over (TCG runs
#: L1, and L1's nested SVM runs the microVM, also under TCG).
SLOW = 900.0
#: Per-test ceiling (pytest-timeout).
TEST_TIMEOUT = 3600


@pytest.fixture(scope="module")
def kvm_host() -> Iterator[KvmHost]:
    reason = unavailable_reason()
    if reason is not None:
        print(f"SKIP emulated KVM host: {reason}")
        pytest.skip(reason)
    try:
        with KvmHost.boot() as host:
            print(f"emulated KVM host: node up {host.boot_s:.0f} s after QEMU started")
            yield host
            leftover = host.wait_no_firecracker()
            assert not leftover, f"firecracker processes left in L1: {leftover}"
            # Every sandbox was killed: no network namespace, no sandbox directory left in L1 (the
            # node tears them down after a kill has answered).
            left = host.check(
                "for i in $(seq 120); do l=$(ls /run/netns | grep '^ae-';"
                f' ls -A {host.DATA_DIR}/sandboxes 2>&-); [ -z "$l" ] && exit 0; sleep 1; done; echo $l'
            )
            assert not left.split(), f"left in L1 after the tests: {left}"
    except KvmHostUnavailable as exc:
        if "svm" in str(exc).lower() or "/dev/kvm" in str(exc):
            pytest.skip(f"QEMU cannot provide AMD SVM here: {exc}")
        raise


@pytest.fixture(scope="module")
def probe_hosts(kvm_host: KvmHost) -> ProbeHosts:
    return kvm_host.start_probe_hosts()


def _create(
    host: KvmHost, template_or_snapshot: str = "base", timeout: int = 3600, **opts: object
) -> Sandbox:
    return Sandbox.create(
        template_or_snapshot,
        timeout=timeout,
        request_timeout=SLOW,
        **opts,  # type: ignore[arg-type]
        **host.sdk_opts,
    )


def _probe(sbx: Sandbox, hosts: ProbeHosts) -> dict[str, str]:
    return hosts.parse(_run(sbx, hosts.probe_command()))


def _wait_log(host: KvmHost, pattern: str, within: float) -> list[str]:
    deadline = time.monotonic() + within
    while not (lines := _log_lines(host, pattern)):
        assert time.monotonic() < deadline, f"no {pattern!r} in the node's log within {within:.0f} s"
        time.sleep(1)
    return lines


def _run(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=SLOW, request_timeout=SLOW).stdout


def _vmm_rss_mib(host: KvmHost, sbx: Sandbox) -> float:
    """Resident memory of the sandbox's VMM in L1: the guest pages it has faulted in (File: mapped
    from the snapshot; Uffd: copied in by our page server). Printed for docs/KVM.md."""
    out = host.check(
        f"for p in $(pgrep -x firecracker); do "
        f"grep -q {sbx.sandbox_id} /proc/$p/cmdline && ps -o rss= -p $p; done"
    )
    return int(out.split()[0]) / 1024


def _log_lines(host: KvmHost, pattern: str) -> list[str]:
    return [
        line for line in host.server_log.read_text(errors="replace").splitlines() if re.search(pattern, line)
    ]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_cold_boot_commands_files_pty_network_disk_kill(kvm_host: KvmHost, probe_hosts: ProbeHosts) -> None:
    """The first create boots a microVM: its own kernel (Debian's cloud kernel, KVM-clocked),
    envd answering commands, files and a PTY; the default network policy (public addresses
    open, private ranges closed); the template's disk size as its quota (ENOSPC inside); kill
    removes the VMM."""
    sbx = _create(kvm_host)
    try:
        assert "cloud-amd64" in _run(sbx, "uname -r")
        assert (
            "KVM"
            in _run(
                sbx,
                "cat /sys/devices/system/clocksource/clocksource0/available_clocksource; "
                "dmesg | grep -m1 -o 'Hypervisor detected: KVM' || true",
            ).upper()
        )
        sbx.files.write("/home/user/hello.txt", "from the SDK", request_timeout=SLOW)
        assert sbx.files.read("/home/user/hello.txt", request_timeout=SLOW) == "from the SDK"
        assert _run(sbx, "cat /home/user/hello.txt") == "from the SDK"
        out = bytearray()
        pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=SLOW, request_timeout=SLOW)
        sbx.pty.send_stdin(pty.pid, b"stty size; exit\n", request_timeout=SLOW)
        pty.wait(on_pty=lambda data: out.extend(data))
        assert b"24 80" in out
        assert _probe(sbx, probe_hosts) == {"public": "OPEN", "public2": "OPEN", "private": "BLOCKED"}
        size = int(_run(sbx, "df -B1M --output=size / | tail -1"))
        assert DISK_MB * 0.8 <= size <= DISK_MB, f"df / shows {size} MiB for a {DISK_MB} MiB disk"
        with pytest.raises(CommandExitException) as full:
            _run(sbx, f"dd if=/dev/zero of=/home/user/fill bs=1M count={DISK_MB + 64} conv=fsync")
        assert "No space left on device" in full.value.stderr
        assert kvm_host.firecracker_pids(), "no firecracker process in L1"
        assert _log_lines(kvm_host, rf"firecracker {sbx.sandbox_id}: boot in")
    finally:
        sbx.kill(request_timeout=SLOW)
    assert all(s.sandbox_id != sbx.sandbox_id for s in Sandbox.list(**kvm_host.sdk_opts).next_items())


#: MiB a guest process writes (then frees by exiting) before the pause: resident in the VMM
#: until the balloon takes it back.
TOUCHED_MIB = 192


@pytest.mark.timeout(TEST_TIMEOUT)
def test_pause_balloon_disk_tier_snapshots_full_diff_and_file_restore(
    kvm_host: KvmHost, probe_hosts: ProbeHosts
) -> None:
    """A sandbox with an egress policy (all denied but one public address). Paused, it freezes
    with its balloon inflated: the VMM's resident memory in L1 drops by what the guest had
    freed; frozen longer than ``pause_disk_after_seconds`` it moves to disk (a snapshot); resumed
    from there its counting process and policy continue and a program gets the memory back.
    Two snapshots of it are Full then Diff; a sandbox created from the Diff one (File backend:
    the memory file mapped) sees the parent's file and counter."""
    sbx = _create(kvm_host, network={"deny_out": [ALL_TRAFFIC], "allow_out": [probe_hosts.addrs["public2"]]})
    child = None
    policy = {"public": "BLOCKED", "public2": "OPEN", "private": "BLOCKED"}
    try:
        assert _probe(sbx, probe_hosts) == policy
        before = start_state(sbx, timeout=SLOW, request_timeout=SLOW)
        _run(sbx, f"python3 -c \"x = b'x' * ({TOUCHED_MIB} << 20)\"")
        touched = _vmm_rss_mib(kvm_host, sbx)
        assert sbx.pause(request_timeout=SLOW) is True
        frozen = _vmm_rss_mib(kvm_host, sbx)
        inflated = _log_lines(kvm_host, rf"firecracker {sbx.sandbox_id}: freeze: balloon \d+")
        how = inflated[-1].split(": ", 2)[-1]
        print(f"balloon: VMM RSS {touched:.0f} MiB -> {frozen:.0f} MiB frozen; {how}")
        assert touched - frozen >= 64, f"VMM RSS {touched:.0f} -> {frozen:.0f} MiB frozen"
        _wait_log(kvm_host, rf"firecracker {sbx.sandbox_id}: pause \(", PAUSE_DISK_AFTER_S + SLOW)
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=3600, request_timeout=SLOW, **kvm_host.sdk_opts)
        assert_state_continues(resumed, before, timeout=SLOW, request_timeout=SLOW)
        assert _probe(resumed, probe_hosts) == policy
        back = 320
        assert _run(resumed, f"python3 -c \"x = b'x' * ({back} << 20); print(len(x) >> 20)\"").strip() == str(
            back
        )
        first = resumed.create_snapshot(request_timeout=SLOW)
        second = resumed.create_snapshot(request_timeout=SLOW)
        kinds = _log_lines(kvm_host, rf"firecracker {sbx.sandbox_id}: snapshot \((Full|Diff)\)")
        assert [re.search(r"\((Full|Diff)\)", k).group(1) for k in kinds][-2:] == ["Full", "Diff"]  # type: ignore[union-attr]
        child = _create(kvm_host, second.snapshot_id)
        assert_state_continues(child, before, timeout=SLOW, request_timeout=SLOW)
        print(f"File-backed child: VMM RSS {_vmm_rss_mib(kvm_host, child):.0f} MiB")
        assert _log_lines(kvm_host, rf"firecracker {child.sandbox_id}: restore in")
        for snap in (first, second):
            Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=SLOW, **kvm_host.sdk_opts)
    finally:
        for s in (child, sbx):
            if s is not None:
                s.kill(request_timeout=SLOW)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_offline_sandbox_and_its_timeout(kvm_host: KvmHost, probe_hosts: ProbeHosts) -> None:
    """``allow_internet_access=False`` closes every destination; a sandbox past its timeout is
    killed by the node, VMM included."""
    sbx = _create(kvm_host, allow_internet_access=False)
    assert _probe(sbx, probe_hosts) == {"public": "BLOCKED", "public2": "BLOCKED", "private": "BLOCKED"}
    # Set after the probe: at emulated speed a command can outlast any timeout set at create.
    sbx.set_timeout(5, request_timeout=SLOW)
    deadline = time.monotonic() + SLOW
    while sbx.is_running(request_timeout=SLOW):
        assert time.monotonic() < deadline, "the sandbox outlived its timeout"
        time.sleep(5)
    assert not kvm_host.firecracker_pids()


@pytest.mark.timeout(TEST_TIMEOUT)
def test_server_restart_with_microvms_running_then_uffd_fork(kvm_host: KvmHost) -> None:
    """``kill -9`` of the node with a microVM running: the restarted node (now serving restores
    through userfaultfd, our page server) re-attaches it; a fork of it restores with the Uffd
    backend and sees its state. Last in the module: the node keeps serving Uffd restores."""
    sbx = _create(kvm_host)
    child = None
    try:
        before = start_state(sbx, timeout=SLOW, request_timeout=SLOW)
        pids = kvm_host.firecracker_pids()
        kvm_host.restart_server(kill=True, extra_env={"FORKYARD_FIRECRACKER__UFFD": "true"})
        assert set(pids) <= set(kvm_host.firecracker_pids()), "a microVM died with the node"
        assert_state_continues(sbx, before, timeout=SLOW, request_timeout=SLOW)
        snap = sbx.create_snapshot(request_timeout=SLOW)
        child = _create(kvm_host, snap.snapshot_id)
        assert_state_continues(child, before, timeout=SLOW, request_timeout=SLOW)
        print(f"Uffd-backed child: VMM RSS {_vmm_rss_mib(kvm_host, child):.0f} MiB")
        assert "uffd" in kvm_host.check("ps -eo args | grep -c '[f]irecracker.uffd' && echo uffd")
        Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=SLOW, **kvm_host.sdk_opts)
    finally:
        for s in (child, sbx):
            if s is not None:
                s.kill(request_timeout=SLOW)
