"""Snapshots in an S3-compatible store, through the official e2b SDK against real servers: a
snapshot is uploaded after its commit and marked durable; with the node's local copy wiped, a
create from it restores from S3 (files and a running process' memory); a second server on its
own data dir, sharing only the bucket, restores it too (the cross-node case); deleting it frees
its objects on S3. The S3 server is moto's server mode, a process started here.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import ServiceBusyException

from tests.support import base_template_missing
from tests.support.counter import assert_state_continues, start_state
from tests.support.s3 import S3Server, s3_server
from tests.support.server import ServerProcess, serve, start_server

pytestmark = pytest.mark.requires_root("runs gVisor sandboxes")

#: Own subnets: the two servers run side by side on this host.
SUBNET_A = "10.215.0.0/20"
SUBNET_B = "10.215.16.0/20"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with s3_server() as server:
        yield server


def storage_of(server: ServerProcess, snapshot_id: str) -> dict[str, object]:
    listed = httpx.get(server.url + "/snapshots", headers=server.headers, timeout=30).json()
    found = [s for s in listed if s["snapshotID"] == snapshot_id]
    assert found, f"snapshot {snapshot_id} is not listed: {listed}"
    storage = found[0].get("storage")
    assert isinstance(storage, dict), found[0]
    return storage


def wait_durable(
    server: ServerProcess, snapshot_id: str, timeout: float = 90, allow_failed: bool = False
) -> dict[str, object]:
    """Until the snapshot is durable (``allow_failed``: through failed attempts, retried)."""
    deadline = time.monotonic() + timeout
    while True:
        storage = storage_of(server, snapshot_id)
        if storage["durable"]:
            return storage
        assert storage["state"] != "failed" or allow_failed, storage
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} never became durable: {storage}"
        time.sleep(0.2)


def named_by_manifests(s3: S3Server, bucket: str) -> set[str]:
    """Every key the bucket's snapshot manifests name, themselves and their name index included."""
    client = s3.client()

    def doc(key: str) -> Any:
        return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    def chunks(chunk_list: Any) -> set[str]:
        return {f"forkyard/chunks/{digest}" for digest, _ in chunk_list if digest}

    named = set(s3.keys(bucket, "forkyard/names/"))
    for key in s3.keys(bucket, "forkyard/snapshots/"):
        manifest = doc(key)
        named.add(key)
        for entry in manifest["files"]:
            named |= chunks(entry["chunks"])
        for lid in manifest["layers"]:
            named.add(f"forkyard/layers/{lid}.json")
            named |= chunks(doc(f"forkyard/layers/{lid}.json")["chunks"])
    return named


def wipe_local_copy(data_dir: Path, snapshot_id: str) -> list[str]:
    """Remove the snapshot's directory and the disk layers it names (the server is stopped)."""
    snap_dir = data_dir / "snapshots" / snapshot_id
    layers = json.loads((snap_dir / "meta.json").read_text())["layers"]
    shutil.rmtree(snap_dir)
    for layer_id in layers:
        shutil.rmtree(data_dir / "disk-layers" / layer_id)
    return list(layers)


def test_snapshot_restores_from_s3_on_its_node_and_on_another(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    env = s3.forkyard_env(bucket, gc_grace_seconds="0", upload_templates="false")
    with serve(prefix="ae-s3a-", extra_env={**env, "FORKYARD_SANDBOX_SUBNET": SUBNET_A}) as a:
        sbx = Sandbox.create(timeout=300, **a.sdk_opts)
        before = start_state(sbx, "from node a")
        snap = sbx.create_snapshot(name="s3-test")
        storage = wait_durable(a, snap.snapshot_id)
        assert storage["uploadMs"] is not None and storage["cached"]
        keys = s3.keys(bucket)
        assert f"forkyard/snapshots/{snap.snapshot_id}.json" in keys
        assert any(k.startswith("forkyard/layers/") for k in keys), keys
        sbx.kill()

        # Node a loses its local copy (memory image and layers): the restore fetches them.
        a.stop()
        wiped = wipe_local_copy(a.data_dir, snap.snapshot_id)
        restarted = start_server(
            a.data_dir, port=a.port, api_key=a.api_key, extra_env={**env, "FORKYARD_SANDBOX_SUBNET": SUBNET_A}
        )
        try:
            assert not storage_of(restarted, snap.snapshot_id)["cached"]
            child = Sandbox.create(snap.snapshot_id, timeout=300, **a.sdk_opts)
            assert_state_continues(child, before, "from node a")
            assert all((a.data_dir / "disk-layers" / lid).is_dir() for lid in wiped)
            assert storage_of(restarted, snap.snapshot_id)["cached"]
            assert "fetched snapshot " + snap.snapshot_id in restarted.log_path.read_text()
            child.kill()

            # Node b: its own data dir and registry, only the bucket shared; running at the same time.
            with serve(prefix="ae-s3b-", extra_env={**env, "FORKYARD_SANDBOX_SUBNET": SUBNET_B}) as b:
                other = Sandbox.create("s3-test", timeout=300, **b.sdk_opts)  # by name
                assert other.sandbox_id != child.sandbox_id
                assert_state_continues(other, before, "from node a")
                assert storage_of(b, snap.snapshot_id)["durable"]
                other.kill()

                # Deleted on b: gone from the store, so every node's later lookups miss it.
                Sandbox.delete_snapshot(snap.snapshot_id, **b.sdk_opts)
                left = set(s3.keys(bucket))
                assert not [k for k in left if snap.snapshot_id in k], left
                # What is left is exactly what the remaining (template) snapshots name.
                assert left == named_by_manifests(s3, bucket)
                assert not [lid for lid in wiped if f"forkyard/layers/{lid}.json" in left]
                with pytest.raises(Exception) as missing:
                    Sandbox.create(snap.snapshot_id, timeout=60, **b.sdk_opts)
                assert "404" in str(missing.value) or "not found" in str(missing.value).lower()
        finally:
            restarted.kill_all_sandboxes()
            restarted.stop()


def wait_evicted(server: ServerProcess, snapshot_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while storage_of(server, snapshot_id)["cached"]:
        assert time.monotonic() < deadline, f"the copy of {snapshot_id} was never evicted"
        time.sleep(0.2)


def test_eviction_under_a_small_cap_never_breaks_a_paused_sandbox(s3: S3Server) -> None:
    """With a 1 MiB cache every durable copy is evicted as soon as it is not in use, and the
    layer collection runs after each eviction: a sandbox paused to disk on top of an evicted
    snapshot's layers still resumes with its files and process."""
    env = {
        **s3.forkyard_env(s3.new_bucket(), gc_grace_seconds="0", upload_templates="false", cache_max_mib="1"),
        "FORKYARD_SANDBOX_SUBNET": SUBNET_A,
        "FORKYARD_PAUSE_FREEZE": "false",  # pause to disk: the pause snapshot stands on the layers
        "FORKYARD_SNAPSHOT_STANDBYS": "0",
    }
    with serve(prefix="ae-s3c-", extra_env=env) as server:
        parent = Sandbox.create(timeout=300, **server.sdk_opts)
        parent.files.write("/home/user/base.txt", "in the snapshot's layer")
        first = parent.create_snapshot()
        wait_durable(server, first.snapshot_id)
        wait_evicted(server, first.snapshot_id)

        child = Sandbox.create(first.snapshot_id, timeout=300, **server.sdk_opts)  # fetched back
        before = start_state(child, "paused on evicted layers")
        child.pause()
        wait_evicted(server, first.snapshot_id)
        # More uploads, evictions and layer collections while the child is paused.
        second = parent.create_snapshot()
        wait_durable(server, second.snapshot_id)
        wait_evicted(server, second.snapshot_id)
        parent.kill()  # a kill runs the layer collection too
        time.sleep(1)

        resumed = Sandbox.connect(child.sandbox_id, timeout=300, **server.sdk_opts)
        assert_state_continues(resumed, before, "paused on evicted layers")
        assert resumed.files.read("/home/user/base.txt") == "in the snapshot's layer"
        assert "nothing more can be evicted" in server.log_path.read_text()  # the cap was hit
        resumed.kill()


def test_a_store_out_of_reach_queues_uploads_and_refuses_only_uncached_restores() -> None:
    """The snapshot store stopped for a while (issue 28): a snapshot taken meanwhile is
    committed on the node and its upload waits; creates from a snapshot the node holds go on; a
    create from one it does not hold fails with a clear 503; once the store is back the waiting
    upload goes through by itself."""
    with s3_server() as store:
        bucket = store.new_bucket()
        env = {**store.forkyard_env(bucket, upload_templates="false"), "FORKYARD_SANDBOX_SUBNET": SUBNET_A}
        with serve(prefix="ae-s3o-", extra_env=env) as node:
            sbx = Sandbox.create(timeout=300, **node.sdk_opts)
            other = Sandbox.create(timeout=300, **node.sdk_opts)  # shares no disk layer with sbx
            before = start_state(sbx, "before the outage")
            cached, uncached = sbx.create_snapshot(), other.create_snapshot()
            wait_durable(node, cached.snapshot_id)
            wait_durable(node, uncached.snapshot_id)
            sbx.kill()
            other.kill()
            node.stop()
            wipe_local_copy(node.data_dir, uncached.snapshot_id)
            restarted = start_server(node.data_dir, port=node.port, api_key=node.api_key, extra_env=env)
            try:
                ids = (cached.snapshot_id, uncached.snapshot_id)
                queued = _during_an_outage(store, bucket, restarted, *ids, before)
                wait_durable(restarted, queued, timeout=90, allow_failed=True)
                assert f"forkyard/snapshots/{queued}.json" in store.keys(bucket)
            finally:
                restarted.kill_all_sandboxes()
                restarted.stop()


def _during_an_outage(
    store: S3Server, bucket: str, node: ServerProcess, cached: str, uncached: str, before: Any
) -> str:
    """Stop the store, use the node, start the store again (empty: the bucket is made again);
    the id of the snapshot taken meanwhile."""
    store.stop()
    try:
        child = Sandbox.create(cached, timeout=300, **node.sdk_opts)
        assert_state_continues(child, before, "before the outage")
        queued = child.create_snapshot()  # committed here; its upload waits for the store
        assert not storage_of(node, queued.snapshot_id)["durable"]
        with pytest.raises(ServiceBusyException) as refused:
            Sandbox.create(uncached, timeout=60, **node.sdk_opts)
        assert "snapshot store" in str(refused.value)  # says why: the store, out of reach
        child.kill()
        return queued.snapshot_id
    finally:
        store.start()
        store.client().create_bucket(Bucket=bucket)
