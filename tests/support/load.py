"""A steady stream of E2B calls from several clients, for the fault tests: each client loops
create -> write a token file -> command -> (every ``snapshot_every`` rounds) snapshot -> kill,
through the official SDK, and records every call (when, how long, ok or the error).

    with Load(cluster.sdk, clients=3) as load:
        ...  # make the fault happen
    report = load.report(fault_started, fault_ended)

A call that takes longer than ``hang_s`` counts as hung (the SDK's request timeout is set below it,
so a call that hangs ends with a timeout error and is counted, never blocks the test). Acknowledged
snapshots are kept with the token their sandbox held: :meth:`Load.snapshots` for the data-loss
check. Sandboxes the clients made are killed in their loop; a failed kill leaves the id in
:attr:`Load.unkilled` for the test to clean up.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from e2b import Sandbox

REQUEST_TIMEOUT_S = 60.0
HANG_S = 90.0
BACKOFF_S = 0.5
TOKEN_FILE = "/home/user/token.txt"


@dataclass
class Call:
    op: str
    started: float
    ended: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Report:
    calls: int
    failed: int
    hung: int
    errors: dict[str, int]
    #: One message per kind of error (what the client saw).
    samples: dict[str, str]
    #: Seconds from the end of the fault to the first create after it that went through.
    recovery_s: float | None
    #: What the client saw of every failed call ("<exception type>: <message>").
    failures: list[str] = field(default_factory=list)
    #: Filled in by the test after the load: what the fault lost, what it leaked.
    lost: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)

    def line(self) -> str:
        rec = "never" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        counts = f"{self.calls} calls, {self.failed} failed, {self.hung} hung"
        return f"{counts}, recovery {rec}, errors {self.errors}"


@dataclass
class Load:
    sdk: dict[str, str]
    clients: int = 3
    snapshot_every: int = 3
    calls: list[Call] = field(default_factory=list)
    snapshots: dict[str, str] = field(default_factory=dict)  # snapshot id -> token
    unkilled: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Load:
        for n in range(self.clients):
            thread = threading.Thread(target=self._client, args=(n,), daemon=True, name=f"load-{n}")
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=HANG_S * 4)
        assert not any(t.is_alive() for t in self._threads), "a load client hangs"

    def wait_calls(self, ok_creates: int, after: float = 0.0, timeout: float = 300) -> None:
        """Until ``ok_creates`` more creates started at or after ``after`` (monotonic) have gone
        through: the load is flowing (again)."""
        target = self._ok_creates(after) + ok_creates
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._ok_creates(after) < target:
                left = deadline - time.monotonic()
                assert left > 0, f"the load made no progress: {self.report(0, 0).line()}"
                self._progress.wait(left)

    def wait_failed(self, after: float, timeout: float = 60) -> None:
        """Until a call that ended at or after ``after`` (monotonic) has failed: the fault is felt."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while not any(not c.ok and c.ended >= after for c in self.calls):
                left = deadline - time.monotonic()
                assert left > 0, f"no call failed during the fault: {self.report(after, after).line()}"
                self._progress.wait(left)

    @property
    def _progress(self) -> threading.Condition:
        if not hasattr(self, "_cond"):
            self._cond = threading.Condition(self._lock)
        return self._cond

    def _ok_creates(self, after: float) -> int:
        return sum(1 for c in self.calls if c.op == "create" and c.ok and c.started >= after)

    def _call(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # every failure counts, whatever its kind
            self._record(Call(op, started, time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
            return None
        self._record(Call(op, started, time.monotonic()))
        return result

    def _record(self, call: Call) -> None:
        with self._progress:
            self.calls.append(call)
            self._progress.notify_all()

    def _client(self, n: int) -> None:
        opts = {**self.sdk, "request_timeout": REQUEST_TIMEOUT_S}
        rounds = 0
        while not self._stop.is_set():
            rounds += 1
            sbx = self._call("create", Sandbox.create, timeout=300, **opts)
            if sbx is None:
                # A client backs off after a failure, as the SDK's users do: without it a refused
                # connection (the gateway restarting) is thousands of failed calls a second.
                self._stop.wait(BACKOFF_S)
                continue
            token = secrets.token_hex(8)
            self._call("write", sbx.files.write, TOKEN_FILE, token, request_timeout=REQUEST_TIMEOUT_S)
            self._call("command", sbx.commands.run, f"cat {TOKEN_FILE}", request_timeout=REQUEST_TIMEOUT_S)
            if rounds % self.snapshot_every == n % self.snapshot_every:
                snap = self._call("snapshot", sbx.create_snapshot, request_timeout=REQUEST_TIMEOUT_S)
                if snap is not None:
                    with self._lock:
                        self.snapshots[snap.snapshot_id] = token
            if self._call("kill", _kill, sbx) is None:
                with self._lock:
                    self.unkilled.append(sbx.sandbox_id)

    def report(self, fault_started: float, fault_ended: float) -> Report:
        with self._lock:
            during = [c for c in self.calls if c.ended >= fault_started]
        failed = [c for c in during if not c.ok]
        errors: dict[str, int] = {}
        samples: dict[str, str] = {}
        for call in failed:
            key = f"{call.op}: {call.error.split(':')[0]}"
            errors[key] = errors.get(key, 0) + 1
            samples.setdefault(key, call.error)
        after = sorted(c.ended for c in during if c.op == "create" and c.ok and c.started >= fault_ended)
        return Report(
            calls=len(during),
            failed=len(failed),
            hung=sum(1 for c in during if c.seconds > HANG_S),
            errors=errors,
            samples=samples,
            recovery_s=(after[0] - fault_ended) if after else None,
            failures=[c.error for c in failed],
        )


def _kill(sbx: Sandbox) -> bool:
    sbx.kill(request_timeout=REQUEST_TIMEOUT_S)
    return True


#: E2B's answers for a part of the cluster that is out of reach or full: 503 (the SDK's
#: ServiceBusyException: retry) and 507 (the disk is full).
_ANSWERED = re.compile(r"(?:^|: )(503|507): ")
#: Errors of a request that no server answered (the only gateway restarting: its port refuses or
#: resets connections, or closes one a request was on); the SDK's own exception types for them.
_TRANSPORT = ("RemoteProtocolError", "WriteError", "ReadError", "ConnectError", "SandboxUnreachableException")


def unclean(failures: list[str], *, gone: bool = False, unanswered: bool = False) -> list[str]:
    """The failures that are not a clean answer to the fault: anything but a 503/507 in E2B's
    shape, a 404 for a sandbox that died with its node (``gone``), a connection no server was
    there to answer (``unanswered``). A 500, a non-JSON answer, a timeout are never clean."""
    left = []
    for error in failures:
        kind = error.split(":", 1)[0]
        if _ANSWERED.search(error):
            continue
        if gone and kind == "NotFoundException":
            continue
        if unanswered and kind in _TRANSPORT and "error sending request" in error:
            continue
        left.append(error)
    return left
