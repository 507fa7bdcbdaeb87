"""zipage-jax: a JAX/Pallas inference engine with Compressed PagedAttention."""

from zipage_jax.config import CompressionConfig, EngineConfig
from zipage_jax.llm import LLM, generate
from zipage_jax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "generate", "EngineConfig", "CompressionConfig"]
