from zipage_jax.config import CompressionConfig, EngineConfig  # noqa: F401
