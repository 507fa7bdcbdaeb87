"""OpenAI-compatible HTTP server over the engine (scripts/serve_jax.py)."""

from zipage_jax.server.app import create_app

__all__ = ["create_app"]
