"""The agent inside the emulated KVM host (:mod:`tests.support.kvmhost`): runs shell scripts as root
on request of the tests outside (start, stop or kill the node; look at processes). Standard library
only: it runs in L1 chrooted into this machine's root, before anything else.

``python kvmhost_agent.py SESSION_DIR``: the bearer token is ``SESSION_DIR/token`` (the session
directory is shared with the outer host over 9p); it listens on port 7000 (QEMU forwards a
loopback port of the outer host to it)."""

from __future__ import annotations

import json
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PORT = 7000


def make_handler(token: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {token}" or self.path != "/exec":
                self.send_error(403)
                return
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            try:
                proc = subprocess.run(
                    ["sh", "-c", request["script"]],
                    capture_output=True,
                    timeout=float(request.get("timeout", 300)),
                    check=False,
                )
                result = {"rc": proc.returncode, "out": (proc.stdout + proc.stderr).decode(errors="replace")}
            except subprocess.TimeoutExpired as exc:
                result = {"rc": -1, "out": f"timed out: {exc}"}
            body = json.dumps(result).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def main() -> int:
    session = Path(sys.argv[1])
    token = (session / "token").read_text().strip()
    print("fy-l1: agent listening", flush=True)
    ThreadingHTTPServer(("0.0.0.0", PORT), make_handler(token)).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
