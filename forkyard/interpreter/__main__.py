"""``python3 -m interpreter serve`` (the server) or ``python3 -m interpreter`` (the supervisor that
keeps the server running: the template's start command)."""

from __future__ import annotations

import sys

from .supervisor import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
