"""``sudo`` inside a gVisor sandbox: asks envd's sudo broker (sudo.py) to run the command.

Runs as the calling user through the envd bundle's interpreter (``/.forkyard/bin/sudo``, mounted
over /usr/bin/sudo). It sends its arguments, environment and working directory with its
stdin/stdout/stderr attached, passes on the signals it gets, and exits with the command's exit
code. Only the standard library: it starts on every ``sudo``.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

SOCKET_NAME = b"\0forkyard-envd-sudo"  # sudo.SOCKET_NAME (not imported: keep start-up small)
_RELAYED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGCONT")


def _request(argv: list[str]) -> bytes:
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": cwd}).encode()
    return len(body).to_bytes(4, "big") + body


def main(argv: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET_NAME)
    except OSError as exc:
        sys.stderr.write(f"sudo: envd's sudo broker is unreachable: {exc.strerror or exc}\n")
        return 1
    request = _request(argv)
    # Our own ids, which the kernel checks, are how envd knows who asks (sudo.py).
    credentials = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    ancillary = [
        (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes()),
        (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, credentials),
    ]
    conn.sendmsg([request[:65536]], ancillary)
    if len(request) > 65536:
        conn.sendall(request[65536:])
    for name in _RELAYED:
        signal.signal(getattr(signal, name), lambda number, _frame: _relay(conn, number))
    answer = b""
    while not answer.endswith(b"\n"):
        try:
            chunk = conn.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            sys.stderr.write("sudo: envd's sudo broker went away\n")
            return 1
        answer += chunk
    reply = json.loads(answer)
    if reply.get("message"):
        sys.stderr.write(str(reply["message"]) + "\n")
    return int(reply.get("exit", 1))


def _relay(conn: socket.socket, number: int) -> None:
    try:
        conn.sendall(json.dumps({"signal": number}).encode() + b"\n")
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
