"""Engine options, with vLLM / Zipage names, validated once at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Redundancy = Literal["none", "lightning", "raw"]
EvictionPolicy = Literal["zipage", "streaming", "window", "vnorm-window"]
EVICTION_POLICIES = ("zipage", "streaming", "window", "vnorm-window")  # see zipage_jax/compress/policies.py


@dataclass(frozen=True)
class CompressionConfig:
    """How a full sequence picks the tokens it keeps (docs/ALGORITHM.md sections 4-5).

    Frozen and hashable: it is a static argument of the jitted compression step.
    """

    budget_blocks: int  # M: blocks kept after compression (the sequence holds at most M + 1)
    block_size: int
    query_cache_len: int = 16
    use_global_score: bool = False
    decay_factor: float = 0.8
    max_norm: bool = False
    enable_pooling: bool = False
    continues_pooling: bool = False
    pooling_size: int = 5
    redundancy: Redundancy = "none"
    redundancy_lambda: float = 0.2
    redundancy_temperature: float = 0.4
    redundancy_threshold: float = 0.5
    sink_len: int = 0
    eviction_policy: EvictionPolicy = "zipage"
    recent_fraction: float = 0.75  # share of the budget protected as a recent window ("window" policies)

    @property
    def budget_tokens(self) -> int:
        return self.budget_blocks * self.block_size


@dataclass
class EngineConfig:
    model: str = "default"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None  # None: sized from kvcache_memory_gb
    kvcache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "xla", "pallas"] = "auto"
    seed: int = 0
    compilation_cache_dir: str | None = None  # None: $ZIPAGE_JAX_CACHE/xla or ~/.cache/zipage_jax/xla; "": off
    log_interval_s: float = 10.0
    # compression (None = full KV)
    max_cache_blocks_per_seq: int | None = None
    query_cache_len: int = 16
    use_global_score: bool = True  # accumulated attention with decay (+0.010 text ppl_ratio for "window" at 1/8)
    decay_factor: float = 0.8
    max_norm: bool = False
    enable_pooling: bool = False
    continues_pooling: bool = False
    pooling_size: int = 5
    redundancy: Redundancy = "none"
    redundancy_lambda: float = 0.2
    redundancy_temperature: float = 0.4
    sink_len: int = 0
    eviction_policy: EvictionPolicy = "vnorm-window"  # best measured (docs/RESULTS.md); "zipage" = reference
    recent_fraction: float = 0.75  # "window" policies: share of the budget kept as the most recent tokens
    enable_async_compress: bool = True
    enable_hybrid_engine: bool = True
    max_compress_seqs: int = 8  # sequences compacted in one step
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        bs = self.kvcache_block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {bs}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 2:
            raise ValueError(f"num_kvcache_blocks must be >= 2, got {self.num_kvcache_blocks}")
        if self.kvcache_memory_gb <= 0:
            raise ValueError(f"kvcache_memory_gb must be > 0, got {self.kvcache_memory_gb}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention_backend must be auto, xla or pallas, got {self.attention_backend!r}")
        if self.max_cache_blocks_per_seq is not None:
            _positive("max_cache_blocks_per_seq", self.max_cache_blocks_per_seq)
        if not 1 <= self.query_cache_len <= bs:
            raise ValueError(f"query_cache_len must be in [1, kvcache_block_size={bs}], got {self.query_cache_len}")
        if self.pooling_size < 1 or self.pooling_size % 2 == 0:
            raise ValueError(f"pooling_size must be a positive odd number, got {self.pooling_size}")
        if self.redundancy not in ("none", "lightning", "raw"):
            raise ValueError(f"redundancy must be none, lightning or raw, got {self.redundancy!r}")
        if not 0.0 <= self.redundancy_lambda <= 1.0:
            raise ValueError(f"redundancy_lambda must be in [0, 1], got {self.redundancy_lambda}")
        if self.redundancy_temperature <= 0:
            raise ValueError(f"redundancy_temperature must be > 0, got {self.redundancy_temperature}")
        if not 0.0 < self.decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in (0, 1], got {self.decay_factor}")
        if self.sink_len < 0:
            raise ValueError(f"sink_len must be >= 0, got {self.sink_len}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction_policy!r}")
        if not 0.0 <= self.recent_fraction < 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1), got {self.recent_fraction}")
        _positive("max_compress_seqs", self.max_compress_seqs)
        _positive("tensor_parallel_size", self.tensor_parallel_size)

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**options)

    def compression(self, budget_blocks: int) -> CompressionConfig:
        """The frozen scoring options for one budget: every CompressionConfig field that is
        also an engine option is copied from here."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(CompressionConfig) if hasattr(self, f.name)}
        return CompressionConfig(budget_blocks=budget_blocks, block_size=self.kvcache_block_size, **shared)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
