"""Adapters that let agent frameworks built for other sandboxes run on E2B-compatible APIs.

Each module imports its framework lazily (inside functions or under ``TYPE_CHECKING``), so
``import forkyard_rl`` never needs them; only the ``e2b`` SDK is a dependency of forkyard-rl.
"""
