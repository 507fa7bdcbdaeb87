"""OpenAI-compatible HTTP server over the engine (`zipage-jax serve`: zipage_jax/commands/serve.py)."""

from zipage_jax.server.app import create_app

__all__ = ["create_app"]
