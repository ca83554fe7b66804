"""envd's issue-10 details without a sandbox: the stream deadline, the metadata store and the
watch events of an upload (real inotify on the test's own directory). The same behaviours
through the SDK in a gVisor sandbox: tests/system/test_envd_details.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.method import IdempotencyLevel, MethodInfo
from connectrpc.request import RequestContext
from starlette.datastructures import Headers

from forkyard.envd.filesystem.inotify import DirectoryWatcher, WatchEvent
from forkyard.envd.filesystem.metadata_store import MetadataStore
from forkyard.envd.filesystem.tempnames import temp_upload_name
from forkyard.envd.http.rpc import DEADLINE_MESSAGE, with_deadline
from forkyard.envd.proto.filesystem_pb import EventType


def _ctx(timeout_ms: int | None) -> RequestContext[Any, Any]:
    method: MethodInfo[Any, Any] = MethodInfo(
        name="Start", service_name="process.Process", input=object, output=object,
        idempotency_level=IdempotencyLevel.UNKNOWN,
    )  # fmt: skip
    return RequestContext(method=method, http_method="POST", request_headers=Headers(), timeout_ms=timeout_ms)


async def test_a_stream_past_its_deadline_ends_with_deadline_exceeded() -> None:
    closed = asyncio.Event()

    async def quiet(request: object, ctx: RequestContext[Any, Any]) -> AsyncIterator[str]:
        try:
            yield "start"
            await asyncio.sleep(30)
            yield "never"
        finally:
            closed.set()

    started = time.monotonic()
    got: list[str] = []
    with pytest.raises(ConnectError) as info:
        async for item in with_deadline(quiet)(None, _ctx(300)):
            got.append(item)
    assert got == ["start"] and 0.25 < time.monotonic() - started < 5
    assert (info.value.code, info.value.message) == (Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
    assert closed.is_set()  # the handler's clean-up ran (a process stream unsubscribes there)


async def test_a_stream_without_a_deadline_runs_to_its_end() -> None:
    async def short(request: object, ctx: RequestContext[Any, Any]) -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0.01)
            yield i

    assert [i async for i in with_deadline(short)(None, _ctx(None))] == [0, 1, 2]
    assert [i async for i in with_deadline(short)(None, _ctx(10_000))] == [0, 1, 2]


def test_metadata_store_follows_envd_operations_and_survives_a_restart(tmp_path: Path) -> None:
    files, store_dir = tmp_path / "files", tmp_path / "store"
    (files / "d").mkdir(parents=True)
    for name in ("a.txt", "d/b.txt", "d/c.txt"):
        (files / name).write_text("x")
    store = MetadataStore(str(store_dir))
    store.start()
    assert store.get(str(files / "a.txt")) is None  # nothing stored: no lookup at all
    store.set(str(files / "a.txt"), {"k": "1"})
    store.set(str(files / "d/b.txt"), {"k": "2"})
    store.set(str(files / "d/c.txt"), {"k": "3"})
    os.rename(files / "d", files / "e")
    store.move(str(files / "d"), str(files / "e"))
    assert store.get(str(files / "e/b.txt")) == {"k": "2"} and store.get(str(files / "d/b.txt")) is None
    store.set(str(files / "a.txt"), {})  # an upload without metadata clears it
    assert store.get(str(files / "a.txt")) is None
    os.unlink(files / "e/c.txt")  # deleted by a process: dropped when found missing
    assert store.get(str(files / "e/c.txt")) is None

    reloaded = MetadataStore(str(store_dir))  # a fresh boot reads the entries back
    reloaded.start()
    assert reloaded.get(str(files / "e/b.txt")) == {"k": "2"}
    assert reloaded.get(str(files / "e/c.txt")) is None
    reloaded.drop(str(files / "e"))  # Remove of the directory
    assert os.listdir(store_dir) == []
    assert oct(os.stat(store_dir).st_mode & 0o777) == "0o700"


async def test_an_upload_reads_like_e2bs_in_place_write(tmp_path: Path) -> None:
    events: list[WatchEvent] = []
    failures: list[str] = []
    watcher = DirectoryWatcher(str(tmp_path), False, events.append, failures.append)

    def upload(name: str, data: bytes) -> None:
        target = tmp_path / name
        temp = tmp_path / temp_upload_name(name, target.exists())
        temp.write_bytes(data)
        os.chmod(temp, 0o644)  # what the upload does to its temp file: never shown
        os.replace(temp, target)

    try:
        upload("f.txt", b"one")
        upload("f.txt", b"two")
        upload("empty.txt", b"")
        for _ in range(500):  # up to 10 s: inotify events arrive late on a loaded machine
            await asyncio.sleep(0.02)
            if len(events) >= 7:
                break
        await asyncio.sleep(0.1)  # anything that would wrongly follow
    finally:
        watcher.close()
    assert not failures
    c, m, w = EventType.CREATE, EventType.CHMOD, EventType.WRITE
    assert [(e.name, e.type) for e in events] == [
        ("f.txt", c), ("f.txt", m), ("f.txt", w),
        ("f.txt", m), ("f.txt", w),
        ("empty.txt", c), ("empty.txt", m),
    ]  # fmt: skip
