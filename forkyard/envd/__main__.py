"""``python -m forkyard.envd``: serve envd with uvicorn (h11, one process, no reload)."""

from __future__ import annotations

from forkyard.envd.server import main

if __name__ == "__main__":
    main()
