"""GvisorRuntime with real runsc: create from ``base``, envd through the e2b SDK, kill, no leaks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.connection_config import ConnectionConfig
from packaging.version import Version

from forkyard.config import GvisorSettings
from forkyard.errors import Failed, Gone
from forkyard.runtime.gvisor import cgroups, disk, platforms
from forkyard.runtime.gvisor.runsc import CONTROL_SOCKET_DIRS, Runsc
from forkyard.runtime.gvisor.runtime import GvisorRuntime
from forkyard.runtime.gvisor.state import GvisorState
from forkyard.types import SandboxInstance, SandboxSpec, SnapshotRef, TemplateImage
from tests.support import leaks, unique_id
from tests.support.fixtures import RuntimeFactory, SandboxFactory

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.requires_root("gVisor sandboxes (runsc, netns, cgroups)"),
]


@pytest.fixture(scope="module")
def gvisor(runtime_factory: RuntimeFactory) -> GvisorRuntime:
    runtime = runtime_factory("gvisor")
    assert isinstance(runtime, GvisorRuntime)
    return runtime


def sdk_sandbox(instance: SandboxInstance, token: str | None = None) -> Sandbox:
    """The official SDK pointed straight at the sandbox's envd (no control plane)."""
    headers = {"E2b-Sandbox-Id": instance.sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = token
    config = ConnectionConfig(
        sandbox_url=instance.envd_url, api_key="e2b_test", extra_sandbox_headers=headers
    )
    return Sandbox(
        sandbox_id=instance.sandbox_id,
        sandbox_domain=None,
        envd_version=Version("0.6.4"),
        envd_access_token=token,
        connection_config=config,
    )


async def run(instance: SandboxInstance, cmd: str, user: str = "root", limit: float = 60) -> tuple[int, str]:
    """Run ``cmd`` in the sandbox through envd's Process service; (exit code, stdout+stderr)."""
    sbx = sdk_sandbox(instance)

    def call() -> tuple[int, str]:
        from e2b.sandbox.commands.command_handle import CommandExitException

        try:
            result = sbx.commands.run(cmd, user=user, timeout=limit)  # type: ignore[arg-type]
        except CommandExitException as exc:
            return exc.exit_code, exc.stdout + exc.stderr
        return result.exit_code, result.stdout + result.stderr

    return await asyncio.to_thread(call)


def leftovers(runtime: GvisorRuntime, sandbox_id: str) -> dict[str, object]:
    """Every host resource of the sandbox that still exists (empty when it is fully gone)."""
    mounts = leaks.mounts_naming(sandbox_id)
    paths = runtime.paths(sandbox_id)
    runsc_root = runtime.runsc.root
    found: dict[str, object] = {
        "processes": runtime.runsc.processes(paths),
        "mounts": mounts,
        "netns": leaks.netns_exists(sandbox_id),
        "cgroups": cgroups.existing(sandbox_id),
        "dir": paths.root.exists(),
        "runsc_state": (runsc_root / paths.container_id).exists()
        or any(p.name.startswith(paths.container_id) for p in runsc_root.glob("*")),
        "control_sockets": [
            sock
            for d in (runsc_root, *CONTROL_SOCKET_DIRS)
            if (sock := d / f"runsc-{paths.container_id}.sock").exists()
        ],
    }
    return {k: v for k, v in found.items() if v}


async def test_probe_and_platform(gvisor: GvisorRuntime) -> None:
    assert gvisor.probe() is None
    # kvm only where /dev/kvm can run hardware-virtualised guests; this check must agree.
    from forkyard.runtime.kvm import kvm_unusable_reason

    assert gvisor.runsc.platform() in ("kvm", "ptrace", "systrap")
    if kvm_unusable_reason() is not None:
        assert gvisor.runsc.platform() != "kvm"


async def test_auto_platform_is_measured_once_and_cached(gvisor: GvisorRuntime, tmp_path: Path) -> None:
    """``auto`` times each platform's run, process start, checkpoint and restore, keeps the
    fastest by :data:`platforms.WEIGHTS`, and a second runtime reads the cache instead."""
    settings = GvisorSettings(runsc_path=gvisor.runsc.binary, platform="auto")
    cache = tmp_path / "platform.json"
    started = time.monotonic()
    chosen = Runsc(settings, tmp_path / "root", tmp_path / "probe", platform_cache=cache).platform()
    print(f"\nauto platform {chosen}, measured in {time.monotonic() - started:.1f}s: {cache.read_text()}")
    (entry,) = json.loads(cache.read_text()).values()
    measured = entry["measured"]
    assert entry["platform"] == chosen == min(measured, key=lambda p: platforms.score(measured[p]))
    assert all(set(m) == set(platforms.WEIGHTS) and min(m.values()) > 0 for m in measured.values())
    assert not (tmp_path / "probe").exists()  # the probe's runsc root and containers are gone

    import forkyard.runtime.gvisor.runsc as runsc_module

    runsc_module._auto_platforms.clear()  # a new process: only the file remembers
    started = time.monotonic()
    assert Runsc(settings, tmp_path / "root", tmp_path / "probe", platform_cache=cache).platform() == chosen
    assert time.monotonic() - started < 0.5


async def test_old_runsc_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "runsc"
    fake.write_text("#!/bin/sh\necho 'runsc version 0.0~20221219.0'\necho 'spec: 1.0.2-dev'\n")
    fake.chmod(0o755)
    runsc = Runsc(GvisorSettings(runsc_path=str(fake)), tmp_path / "root", tmp_path / "probe")
    reason = runsc.unsupported_reason()
    assert reason is not None and "20221219" in reason and "bootstrap" in reason


async def test_create_health_command_kill(
    gvisor: GvisorRuntime, base_template: TemplateImage, sandbox_factory: SandboxFactory
) -> None:
    started = time.monotonic()
    instance = await sandbox_factory(gvisor, envs={"FORKYARD_TEST_VAR": "from-spec"})
    print(f"\ngvisor create to /health: {time.monotonic() - started:.2f}s")
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"{instance.envd_url}/health")
    assert response.status_code == 204
    assert await gvisor.is_alive(instance)

    code, out = await run(instance, "cat /etc/debian_version; echo $FORKYARD_TEST_VAR; id -un; hostname")
    assert code == 0, out
    lines = out.split()
    assert lines[0].startswith("12")  # the base template is bookworm
    assert "from-spec" in lines and "root" in lines
    code, out = await run(instance, "id -u; echo $HOME", user="user")
    assert code == 0 and out.split() == ["1000", "/home/user"], out

    # Writes land in the private upper layer, never in the shared template.
    code, out = await run(instance, "echo data > /home/user/note && cat /home/user/note")
    assert (code, out.strip()) == (0, "data")
    assert (gvisor.paths(instance.sandbox_id).upper / "home/user/note").read_text() == "data\n"
    assert not (base_template.rootfs / "home/user/note").exists()

    metrics = await gvisor.metrics(instance)
    assert metrics.cpu_count == base_template.vcpus
    assert 0 < metrics.mem_used <= metrics.mem_total == base_template.memory_mb << 20
    assert metrics.disk_used > 0

    started = time.monotonic()
    await gvisor.kill(instance)
    print(f"gvisor kill: {time.monotonic() - started:.2f}s")
    assert leftovers(gvisor, instance.sandbox_id) == {}
    assert not await gvisor.is_alive(instance)
    await gvisor.kill(instance)  # idempotent


async def test_python_in_sandbox_is_the_templates(
    gvisor: GvisorRuntime, sandbox_factory: SandboxFactory
) -> None:
    """envd's bundled interpreter must not leak into user processes (PYTHONHOME etc.)."""
    instance = await sandbox_factory(gvisor)
    code, out = await run(
        instance, "python3 -c 'import sys; print(sys.prefix)'; env | grep -c PYTHON || true"
    )
    assert code == 0, out
    assert out.split() == ["/usr", "0"]


async def test_limits_in_oci_spec(gvisor: GvisorRuntime, base_template: TemplateImage) -> None:
    from dataclasses import replace

    from forkyard.runtime.gvisor.runtime import HOST_PIDS_LIMIT, NPROC_LIMIT
    from forkyard.runtime.network import SandboxNetwork

    tpl = replace(base_template, vcpus=3, memory_mb=768)
    spec = SandboxSpec(sandbox_id="specid", template=tpl, envs={"A": "b"}, envd_access_token="tok")
    net = SandboxNetwork("specid", "ae-specid", 7, "aeh7", "aes7", "10.213.0.29", "10.213.0.30")
    config = gvisor.oci_spec(spec, net, Path("/r"), Path("/b"))
    resources = config["linux"]["resources"]
    assert (resources["cpu"]["quota"], resources["cpu"]["period"]) == (300_000, 100_000)
    assert resources["memory"] == {"limit": 768 << 20}
    assert resources["pids"] == {"limit": HOST_PIDS_LIMIT}
    rlimits = {r["type"]: r["hard"] for r in config["process"]["rlimits"]}
    assert rlimits["RLIMIT_NPROC"] == NPROC_LIMIT
    tmp = next(m for m in config["mounts"] if m["destination"] == "/tmp")
    assert "size=384m" in tmp["options"]  # half the memory
    assert {"type": "network", "path": "/var/run/netns/ae-specid"} in config["linux"]["namespaces"]
    assert "A=b" in config["process"]["env"] and "FORKYARD_ENVD_ACCESS_TOKEN=tok" in config["process"]["env"]
    loader = ["/.forkyard/lib/ld-linux-x86-64.so.2", "--library-path", "/.forkyard/lib"]
    assert config["process"]["args"][:3] == loader
    bundle_mount = next(m for m in config["mounts"] if m["destination"] == "/.forkyard")
    assert bundle_mount["source"] == "/b" and "ro" in bundle_mount["options"]


async def test_failed_create_cleans_up(gvisor: GvisorRuntime, tmp_path: Path) -> None:
    """The root file system cannot be mounted (template rootfs vanished) after the network
    was set up: a clear error naming the sandbox, and nothing left behind."""
    broken = TemplateImage(template_id="broken", rootfs=tmp_path / "missing-rootfs")
    sandbox_id = unique_id("bad")
    with pytest.raises(Failed) as err:
        instance = await gvisor.create(SandboxSpec(sandbox_id=sandbox_id, template=broken))
        await gvisor.kill(instance)
    assert sandbox_id in err.value.message and "root file system" in err.value.message
    assert leftovers(gvisor, sandbox_id) == {}


async def test_envd_that_never_answers_times_out(
    gvisor: GvisorRuntime, base_template: TemplateImage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """envd starts but never listens where expected: timeout error and full clean-up."""
    import forkyard.runtime.gvisor.runtime as gv

    monkeypatch.setattr(gv, "envd_argv", lambda port: ["/bin/sleep", "600"])
    monkeypatch.setattr(gv, "ENVD_START_TIMEOUT", 3.0)
    sandbox_id = unique_id("slow")
    started = time.monotonic()
    with pytest.raises(Failed, match="did not answer"):
        await gvisor.create(SandboxSpec(sandbox_id=sandbox_id, template=base_template))
    assert time.monotonic() - started < 30
    assert leftovers(gvisor, sandbox_id) == {}


async def test_cleanup_orphans(gvisor: GvisorRuntime, base_template: TemplateImage) -> None:
    keep_id, orphan_id = unique_id("keep"), unique_id("orph")
    keep = await gvisor.create(SandboxSpec(sandbox_id=keep_id, template=base_template))
    stale = gvisor.settings.data_dir / "envd-runtime" / "0123456789abcdef"
    stale.mkdir()
    try:
        await gvisor.create(SandboxSpec(sandbox_id=orphan_id, template=base_template))
        removed = await gvisor.cleanup_orphans({keep_id})
        assert orphan_id in removed and keep_id not in removed
        assert leftovers(gvisor, orphan_id) == {}
        assert await gvisor.is_alive(keep)
        assert not stale.exists()  # an envd bundle nobody uses any more
        kept_bundle = Path(GvisorState.of(keep).envd_bundle).name
        assert (gvisor.settings.data_dir / "envd-runtime" / kept_bundle).exists()
    finally:
        await gvisor.kill(keep)
    assert leftovers(gvisor, keep_id) == {}


async def test_concurrent_creates_get_distinct_slots(
    gvisor: GvisorRuntime, sandbox_factory: SandboxFactory
) -> None:
    instances = await asyncio.gather(*(sandbox_factory(gvisor) for _ in range(3)))
    assert len({i.address for i in instances}) == 3
    for instance in instances:
        code, out = await run(instance, "echo ok")
        assert (code, out.strip()) == (0, "ok")


async def test_freeze_keeps_the_sandbox_and_thaw_lets_it_go_on(
    gvisor: GvisorRuntime, sandbox_factory: SandboxFactory
) -> None:
    """The frozen pause tier: envd stops answering, the sandbox stays alive with its processes
    and address; a thaw lets the same processes go on; a frozen sandbox can be killed."""
    instance = await sandbox_factory(gvisor)
    code, pid = await run(instance, "sleep 1000 >/dev/null 2>&1 & echo $!")
    assert code == 0, pid
    started = time.monotonic()
    await gvisor.freeze(instance)
    print(f"\ngvisor freeze: {(time.monotonic() - started) * 1000:.1f} ms")
    assert await gvisor.is_alive(instance)
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.TimeoutException):
            await client.get(f"{instance.envd_url}/health", timeout=1.0)
    started = time.monotonic()
    await gvisor.thaw(instance)
    print(f"gvisor thaw: {(time.monotonic() - started) * 1000:.1f} ms")
    code, out = await run(instance, f"kill -0 {pid.strip()} && echo alive")
    assert (code, out.strip()) == (0, "alive")
    await gvisor.thaw(instance)  # thawing a running sandbox changes nothing
    await gvisor.freeze(instance)
    await gvisor.kill(instance)
    assert leftovers(gvisor, instance.sandbox_id) == {}


async def test_snapshot_of_a_running_sandbox_only_pauses_it(
    gvisor: GvisorRuntime,
    base_template: TemplateImage,
    sandbox_factory: SandboxFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``snapshot(stop=False)`` of a small upper: the same processes go on (checkpoint
    ``--leave-running``, the upper copied), a sandbox restored from it sees memory and disk as
    they were, and the sandbox's own disk and chain are untouched. A large upper takes the
    stopping path, which leaves the sandbox an empty upper."""
    instance = await sandbox_factory(gvisor)
    code, pid = await run(instance, "sleep 1000 >/dev/null 2>&1 & echo $!")
    code, out = await run(instance, "head -c 20M /dev/urandom > /home/user/data; md5sum /home/user/data")
    assert code == 0, out
    paths = gvisor.paths(instance.sandbox_id)
    chain_before = gvisor.disks.chain(paths)

    started = time.monotonic()
    await gvisor.snapshot(instance, SnapshotRef("run1", tmp_path / "run1"), stop=False)
    print(f"\nrunning snapshot: {(time.monotonic() - started) * 1000:.0f} ms")
    code, alive = await run(instance, f"kill -0 {pid.strip()} && echo alive; echo more > /home/user/later")
    assert (code, alive.strip()) == (0, "alive")  # the same process, never restored
    assert gvisor.disks.chain(paths) == chain_before and (paths.upper / "home/user/data").exists()
    assert len(gvisor.disks.held(paths)) == 1
    # Paused and resumed over runsc's control socket: runsc's record still says running.
    assert await gvisor.runsc.status(paths.container_id) == "running"
    assert not paths.upper_precopy.exists()

    child_spec = SandboxSpec(sandbox_id=unique_id("child"), template=base_template)
    child = await gvisor.restore(child_spec, SnapshotRef("run1", tmp_path / "run1"))
    try:
        code, child_out = await run(
            child, f"md5sum /home/user/data; kill -0 {pid.strip()} && echo alive; ls /home/user"
        )
        assert code == 0, child_out
        assert child_out.split()[0] == out.split()[0] and "alive" in child_out and "later" not in child_out
    finally:
        await gvisor.kill(child)

    # Over the copy limit: checkpoint, seal, restore in place.
    monkeypatch.setattr(disk, "COPY_MAX_BYTES", 1 << 20)
    await gvisor.snapshot(instance, SnapshotRef("run2", tmp_path / "run2"), stop=False)
    assert not (paths.upper / "home/user/data").exists()
    assert len(gvisor.disks.chain(paths)) == len(chain_before) + 1
    code, out = await run(instance, "cat /home/user/later")
    assert (code, out.strip()) == (0, "more")


async def test_a_restore_whose_disk_fails_leaves_nothing_of_its_network(
    gvisor: GvisorRuntime, base_template: TemplateImage, sandbox_factory: SandboxFactory, tmp_path: Path
) -> None:
    """A restore makes its network and mounts its disk at once: when the disk fails (a layer of
    the snapshot is gone), the network made beside it is torn down with the rest."""
    instance = await sandbox_factory(gvisor)
    ref = SnapshotRef("layers-gone", tmp_path / "layers-gone")
    await gvisor.snapshot(instance, ref, stop=False)
    meta_file = ref.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["layers"] = ["l00000000deadbeef", *meta["layers"]]
    meta_file.write_text(json.dumps(meta))
    links, namespaces = leaks.host_links(), leaks.forkyard_netns()
    child = SandboxSpec(sandbox_id=unique_id("child"), template=base_template)
    with pytest.raises(Gone, match="l00000000deadbeef"):
        await gvisor.restore(child, ref)
    assert leftovers(gvisor, child.sandbox_id) == {}
    assert leaks.host_links() == links and leaks.forkyard_netns() == namespaces


async def test_a_file_the_sandbox_maps_shared_is_seen_and_not_precopied(
    gvisor: GvisorRuntime, sandbox_factory: SandboxFactory
) -> None:
    """gVisor maps a file the sandbox maps shared from the host into its stub processes, where a
    write through the mapping moves no timestamp: the pre-copy must see the mapping (the upper
    file's inode in the maps of the sandbox's processes, shown on the overlay's device) and leave
    the file to the pause."""
    instance = await sandbox_factory(gvisor)
    script = (
        "import mmap, time\n"
        "f = open('/home/user/mapped.bin', 'w+b'); f.truncate(1 << 20); f.flush()\n"
        "m = mmap.mmap(f.fileno(), 1 << 20, mmap.MAP_SHARED); m[0:2] = b'hi'\n"
        "open('/home/user/ready', 'w').close(); time.sleep(120)\n"
    )
    code, out = await run(
        instance,
        f'head -c 1M /dev/urandom > /home/user/plain.bin; python3 -c "{script}" >/dev/null 2>&1 & '
        "for i in $(seq 100); do [ -e /home/user/ready ] && break; sleep 0.1; done; ls /home/user",
    )
    assert code == 0 and "ready" in out, out
    await asyncio.sleep(0.1)  # older than upper_delta.SETTLED_NS
    paths = gvisor.paths(instance.sandbox_id)
    mapped_file, plain_file = paths.upper / "home/user/mapped.bin", paths.upper / "home/user/plain.bin"
    mapped = cgroups.mapped_inodes(instance.sandbox_id)
    assert mapped is not None and mapped_file.stat().st_ino in mapped
    assert plain_file.stat().st_ino not in mapped
    staged = await asyncio.to_thread(gvisor.disks.precopy_upper, paths)
    try:
        assert "home/user/plain.bin" in staged and "home/user/mapped.bin" not in staged
    finally:
        gvisor.disks.drop_precopy(paths)


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """path -> (mode, uid, content or link target) of everything below ``root``."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_symlink():
            what = "-> " + os.readlink(path)
        elif path.is_file():
            what = path.read_text()
        else:
            what = "dir"
        found[str(path.relative_to(root))] = (st.st_mode, st.st_uid, what)
    return found


async def test_upper_deltas_stack_to_the_upper(tmp_path: Path) -> None:
    """Two running-snapshot layers over the mounted chain show exactly the live overlay: new,
    changed, renamed, chmodded, hard-linked and deleted entries, a directory deleted and made
    anew (whose old entries must not show through), a file from the template deleted, and an
    opaque directory that changes again."""
    from forkyard.runtime.gvisor import upper_delta
    from forkyard.storage.layers import overlay_mount, overlay_unmount

    lower, upper, work, live, view = (tmp_path / n for n in ("lower", "upper", "work", "live", "view"))
    for d in (lower / "etc", upper, work, live, view):
        d.mkdir(parents=True)
    (lower / "etc" / "hosts").write_text("template\n")
    (lower / "etc" / "gone").write_text("template\n")
    (lower / "opt" / "pkg").mkdir(parents=True)
    (lower / "opt" / "pkg" / "a").write_text("template\n")
    overlay_mount(live, [lower], upper, work)
    try:
        shutil.rmtree(live / "opt/pkg")  # made anew over the template's: opaque in the upper
        (live / "opt/pkg").mkdir()
        (live / "opt/pkg/b").write_text("b\n")
        (live / "home/user/d").mkdir(parents=True)
        (live / "home/user/d/old").write_text("old\n")
        (live / "home/user/keep").write_text("keep\n")
        (live / "home/user/edit").write_text("v1\n")
        layer1 = tmp_path / "l1"
        entries = upper_delta.build(upper, layer1, {})

        (live / "home/user/edit").write_text("v2\n")
        (live / "opt/pkg/c").write_text("c\n")  # layer 2's opt/pkg must not hide layer 1's b
        shutil.rmtree(live / "home/user/d")
        (live / "home/user/d").mkdir()
        (live / "home/user/d/new").write_text("new\n")
        (live / "home/user/keep").chmod(0o600)
        os.link(live / "home/user/keep", live / "home/user/keep-link")
        (live / "home/user/edit").rename(live / "home/user/moved")
        (live / "etc/gone").unlink()
        os.symlink("moved", live / "home/user/link")
        layer2 = tmp_path / "l2"
        upper_delta.build(upper, layer2, entries)
        assert (layer2 / "home/user/keep-link").samefile(layer2 / "home/user/keep")

        overlay_mount(view, [layer2, layer1, lower], None, None)
        try:
            assert _tree(view) == _tree(live)
        finally:
            overlay_unmount(view)
    finally:
        overlay_unmount(live)
