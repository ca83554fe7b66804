"""Test hosts a sandbox's network policy is probed against: a TCP server that answers ``pong``
on every connection, and the command that, run inside a sandbox, connects to every address at once.
Used on this host (tests/system/test_network_policy.py) and inside the emulated KVM host
(tests/support/kvmhost.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from e2b import Sandbox

#: ``python -c SERVER PORT``: prints ``ready`` once listening. No single quotes: it is also
#: passed inside a single-quoted shell word.
SERVER = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(64)
print("ready", flush=True)
def serve(c):
    with c:
        c.sendall(b"pong")
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

#: Run inside a sandbox: connect to every address at once; "OPEN" or "BLOCKED" per address.
PROBE = """python3 - {port} {timeout} {addrs} <<'EOF'
import json, socket, sys, concurrent.futures as cf
port, timeout = int(sys.argv[1]), float(sys.argv[2])
def probe(a):
    try:
        with socket.create_connection((a, port), timeout=timeout) as c:
            return "OPEN" if c.recv(4) == b"pong" else "ODD"
    except OSError:
        return "BLOCKED"
with cf.ThreadPoolExecutor(len(sys.argv) - 3) as ex:
    print(json.dumps(dict(zip(sys.argv[3:], ex.map(probe, sys.argv[3:])))))
EOF"""


@dataclass
class ProbeHosts:
    """Test hosts by name (``name -> address``), all listening on ``port``."""

    port: int
    addrs: dict[str, str]
    #: Per connection: a closed destination is one that does not answer within it.
    connect_timeout: float = 1.0

    def probe_command(self) -> str:
        return PROBE.format(port=self.port, timeout=self.connect_timeout, addrs=" ".join(self.addrs.values()))

    def parse(self, stdout: str) -> dict[str, str]:
        """name -> OPEN/BLOCKED from :meth:`probe_command`'s output."""
        result = json.loads(stdout)
        return {name: result[addr] for name, addr in self.addrs.items()}

    def probe_in(self, sandbox: Sandbox, timeout: float = 30) -> dict[str, str]:
        """name -> OPEN/BLOCKED for every test host, seen from inside ``sandbox``."""
        return self.parse(sandbox.commands.run(self.probe_command(), timeout=timeout).stdout)
