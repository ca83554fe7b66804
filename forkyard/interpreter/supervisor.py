"""Keeps the server running: gVisor sandboxes have no systemd, so this is the template's start
command. The server is started again whenever it exits (a crash, a kill by the user's code, the
OOM killer), after a short pause that grows while it keeps failing. Kernels die with the server
(jupyter_client's parent poller) and the new server starts its default kernel again.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from . import ENVS_FILE, PORT

logger = logging.getLogger("forkyard.interpreter")

#: Pauses between restarts: from the first to the longest (a server that ran this long is healthy).
FIRST_BACKOFF_S = 0.2
LONGEST_BACKOFF_S = 5.0
HEALTHY_AFTER_S = 30.0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="interpreter")
    parser.add_argument("mode", nargs="?", choices=["supervise", "serve"], default="supervise")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--home", default=os.environ.get("HOME") or "/home/user")
    parser.add_argument("--envs-file", default=ENVS_FILE, help="where envd keeps the sandbox's variables")
    parser.add_argument(
        "--warm", default="python", help="languages whose default context starts with the server"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse(argv)
    if args.mode == "serve":
        return serve(args)
    return supervise(argv)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    warm = tuple(name for name in args.warm.split(",") if name)
    app = create_app(args.home, warm, args.envs_file)
    uvicorn.run(app, host=args.host, port=args.port, http="h11", log_level="warning", access_log=False)
    return 0


def supervise(argv: list[str]) -> int:
    command = [
        sys.executable,
        "-m",
        __package__ or "interpreter",
        "serve",
        *[a for a in argv if a != "supervise"],
    ]
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    backoff = FIRST_BACKOFF_S
    while not stopping:
        started = time.monotonic()
        child = subprocess.Popen(command)
        code = child.wait()
        if stopping:
            break
        ran = time.monotonic() - started
        backoff = FIRST_BACKOFF_S if ran > HEALTHY_AFTER_S else min(backoff * 2, LONGEST_BACKOFF_S)
        logger.warning(
            "the server exited with %s after %.1f s: starting it again in %.1f s", code, ran, backoff
        )
        time.sleep(backoff)
    return 0
