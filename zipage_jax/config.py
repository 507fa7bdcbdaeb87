"""Engine options, with vLLM / Zipage names, validated once at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pallas_kernels.kv_quant import KV_CACHE_DTYPES
from zipage_jax.compress.policies import DEFAULT_POLICY, POLICIES, PolicyOptions, get_policy

Redundancy = Literal["none", "lightning", "raw"]


@dataclass(frozen=True)
class CompressionConfig:
    """The engine-wide scoring options (docs/ALGORITHM.md sections 4-5), a static argument of the
    jitted compression step. Built only by `EngineConfig.compression()`, so the defaults live in
    one place; a sequence's budget and policy are per-row values, not part of it."""

    block_size: int
    query_cache_len: int
    use_global_score: bool
    decay_factor: float
    max_norm: bool
    enable_pooling: bool
    continues_pooling: bool
    pooling_size: int
    redundancy: Redundancy
    redundancy_lambda: float
    redundancy_temperature: float
    redundancy_threshold: float


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
    redundancy_threshold: float = 0.5
    eviction_policy: str = DEFAULT_POLICY  # compress/policies.py; SamplingParams.eviction_policy overrides it
    sink_len: int | None = None  # protected first tokens; None: each policy's own (zipage 0, others 4)
    recent_fraction: float | None = None  # window policies: share of the budget kept as the most recent tokens
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "int8" or "fp8" (e4m3): per-token scales
    enable_async_compress: bool = True
    enable_hybrid_engine: bool = True
    max_compress_seqs: int = 8  # sequences compacted in one step
    tensor_parallel_size: int = 1
    async_scheduling: bool = True  # schedule and dispatch step N+1 before step N's tokens reach the host
    prefill_row_size: int = 32  # tokens per row of a prefill batch (a chunk spans several rows)
    warmup: bool = False  # compile every step shape the configuration can reach at start-up

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
        if not 0.0 <= self.redundancy_threshold <= 1.0:
            raise ValueError(f"redundancy_threshold must be in [0, 1], got {self.redundancy_threshold}")
        get_policy(self.eviction_policy)
        if self.sink_len is not None and (not isinstance(self.sink_len, int) or self.sink_len < 0):
            raise ValueError(f"sink_len must be an integer >= 0, got {self.sink_len!r}")
        if self.recent_fraction is not None and not 0.0 <= self.recent_fraction < 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1), got {self.recent_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        rows = self.prefill_row_size
        if not isinstance(rows, int) or rows < 1 or rows & (rows - 1):
            raise ValueError(f"prefill_row_size must be a power of two >= 1, got {rows!r}")
        _positive("max_compress_seqs", self.max_compress_seqs)
        _positive("tensor_parallel_size", self.tensor_parallel_size)

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**options)

    @property
    def row_size(self) -> int:
        """Tokens per prefill row: prefill_row_size, or less when a step holds fewer tokens."""
        return min(self.prefill_row_size, 1 << (self.max_num_batched_tokens.bit_length() - 1))

    def compression(self) -> CompressionConfig:
        """The engine-wide scoring options: every CompressionConfig field but the block size
        is the engine option of the same name."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(CompressionConfig) if f.name != "block_size"}
        return CompressionConfig(block_size=self.kvcache_block_size, **shared)

    def policy_options(self, policy: str) -> PolicyOptions:
        """A policy's options with this engine's sink_len / recent_fraction overrides."""
        return POLICIES[policy].options(self.sink_len, self.recent_fraction)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
