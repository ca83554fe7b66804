"""``python3 -m interpreter serve``: the server (kept running by ``supervise.sh``, the template's
start command)."""

from __future__ import annotations

import argparse
import logging
import os

from . import ENVS_FILE, PORT


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="interpreter")
    parser.add_argument("mode", nargs="?", choices=["serve"], default="serve")
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
    return serve(parse(argv))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    warm = tuple(name for name in args.warm.split(",") if name)
    app = create_app(args.home, warm, args.envs_file)
    uvicorn.run(app, host=args.host, port=args.port, http="h11", log_level="warning", access_log=False)
    return 0
