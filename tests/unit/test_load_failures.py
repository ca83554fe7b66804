"""The fault tests' judgement of a failed call (tests/support/load.py): what the SDK saw during a
fault is a clean answer (E2B's 503/507, a sandbox gone with its node, no server at all while the
only gateway restarts) or not (a 500, a non-JSON answer, a timeout). Messages as the SDK gave them in
the Compose cluster's fault run."""

from __future__ import annotations

from tests.support.load import unclean

BUSY = (
    "ServiceBusyException: ServiceBusyException: 503: Service temporarily unavailable, please retry."
    " - the node holding this is unreachable; try again"
)
FULL = (
    "SandboxException: SandboxException: 507: sandbox restore failed: the node's disk is full"
    " (OSError: [Errno 28] No space left on device)"
)
GONE = "NotFoundException: NotFoundException: Sandbox abc was not found"
RESET = (
    "WriteError: WriteError: Request failed: error sending request for url"
    " (http://127.0.0.1:45647/v2/sandboxes): client error (SendRequest): connection error:"
    " Connection reset by peer (os error 104)"
)
CLOSED = (
    "RemoteProtocolError: RemoteProtocolError: Request failed: error sending request for url"
    " (http://127.0.0.1:45647/v2/sandboxes): client error (SendRequest): connection closed before"
    " message completed"
)
INTERNAL = "SandboxException: SandboxException: 500: internal server error: DBAPIError"
TIMEOUT = "TimeoutException: TimeoutException: Request timed out"


def test_503_and_507_are_always_clean() -> None:
    assert unclean([BUSY, FULL]) == []


def test_a_500_or_a_timeout_never_is() -> None:
    assert unclean([INTERNAL, TIMEOUT, BUSY], gone=True, unanswered=True) == [INTERNAL, TIMEOUT]


def test_gone_only_where_a_node_died_and_unanswered_only_where_the_gateway_was_down() -> None:
    assert unclean([GONE, RESET, CLOSED]) == [GONE, RESET, CLOSED]
    assert unclean([GONE, RESET, CLOSED], gone=True) == [RESET, CLOSED]
    assert unclean([GONE, RESET, CLOSED], unanswered=True) == [GONE]
