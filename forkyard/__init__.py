"""forkyard: self-hosted, E2B-compatible sandboxes for agentic reinforcement learning."""

__version__ = "0.1.0"
