"""zipage-jax: a JAX/Pallas inference engine with Compressed PagedAttention.

Public names are imported lazily, so host-only modules (engine.sequence, block_manager,
scheduler) load without importing jax.
"""

import importlib

_PUBLIC = {
    "LLM": "zipage_jax.llm",
    "generate": "zipage_jax.llm",
    "SamplingParams": "zipage_jax.sampling_params",
    "StructuredOutputsParams": "zipage_jax.sampling_params",
    "EngineConfig": "zipage_jax.config",
    "CompressionConfig": "zipage_jax.compress.config",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'zipage_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
