"""``python3 -m interpreter serve``: the server (``supervise.sh`` keeps it running)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
