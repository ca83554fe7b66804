"""The synchronous wrappers that are cheap: rollback for the SDK's ``Sandbox``. Everything else
is async; from synchronous code run it with ``asyncio.run(...)``."""

from forkyard_rl.api import rollback_sync as rollback

__all__ = ["rollback"]
