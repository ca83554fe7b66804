"""The cgroup v1 freezer is written again while a freeze reads FREEZING, and a freeze that never
settles leaves the sandbox thawed (runtime/gvisor/freezer.py).

The kernel race behind a stuck FREEZING (a task missing the freezer's one signal per write) cannot
be caused on demand, so a fake ``freezer.state`` plays the kernel: it reads FREEZING until a given
number of FROZEN writes have been made. The real freezer is exercised by the gVisor system tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forkyard.errors import Failed
from forkyard.runtime.gvisor import freezer


class FakeV1Freezer:
    def __init__(self, root: Path, sandbox_id: str, freezes_after_writes: int) -> None:
        state = root / "freezer" / "forkyard" / sandbox_id / "freezer.state"
        state.parent.mkdir(parents=True)
        state.write_text("THAWED")
        self.freezes_after_writes = freezes_after_writes
        self.frozen_writes = 0
        self.state = "THAWED"
        self.writes: list[str] = []

    def write(self, target: Path, value: str, sandbox_id: str, verb: str) -> None:
        self.writes.append(value)
        if value == "FROZEN":
            self.frozen_writes += 1
            self.state = "FROZEN" if self.frozen_writes >= self.freezes_after_writes else "FREEZING"
        else:
            self.state = value

    def read(self, path: Path) -> str:
        return self.state


@pytest.fixture
def fake_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def make(freezes_after_writes: int) -> FakeV1Freezer:
        fake = FakeV1Freezer(tmp_path, "sbx", freezes_after_writes)
        monkeypatch.setattr(freezer, "CGROUP_V1_ROOT", tmp_path)
        monkeypatch.setattr(freezer, "_write", fake.write)
        monkeypatch.setattr(freezer, "_read", fake.read)
        return fake

    return make


async def test_a_freeze_stuck_in_freezing_is_written_again_until_it_settles(fake_kernel) -> None:  # type: ignore[no-untyped-def]
    fake = fake_kernel(freezes_after_writes=4)
    await freezer.freeze("sbx")
    assert fake.state == "FROZEN"
    assert fake.writes == ["FROZEN"] * 4


async def test_a_long_freezing_cgroup_is_thawed_for_a_moment_between_writes(
    fake_kernel,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(freezer, "REFREEZE_THAW_EVERY", 3)
    fake = fake_kernel(freezes_after_writes=6)
    await freezer.freeze("sbx")
    assert fake.state == "FROZEN"
    assert fake.writes[:5] == ["FROZEN", "FROZEN", "FROZEN", "THAWED", "FROZEN"]


async def test_a_freeze_that_never_settles_fails_and_leaves_the_sandbox_running(
    fake_kernel,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(freezer, "SETTLE_SECONDS", 0.2)
    fake = fake_kernel(freezes_after_writes=10**9)
    with pytest.raises(Failed, match="did not freeze"):
        await freezer.freeze("sbx")
    assert fake.state == "THAWED"
    assert fake.writes[-1] == "THAWED"


async def test_a_thaw_is_one_write(fake_kernel) -> None:  # type: ignore[no-untyped-def]
    fake = fake_kernel(freezes_after_writes=1)
    await freezer.freeze("sbx")
    await freezer.thaw("sbx")
    assert fake.writes == ["FROZEN", "THAWED"]
