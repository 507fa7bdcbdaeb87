"""The KV pool's shape, computed once from the config and the model and passed down.

The block manager, the scheduler and the runner read the plan; nobody changes the config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from zipage_jax.config import EngineConfig
from zipage_jax.models.config import ModelConfig

logger = logging.getLogger("zipage_jax")


@dataclass(frozen=True)
class KVPoolPlan:
    block_size: int
    kv_dtype: np.dtype  # what the pools store (the model's dtype, int8, float8_e4m3fn or uint8: packed int4)
    num_kv_heads: int  # per device (tensor parallelism splits them)
    block_bytes: int  # one block of every layer's K and V, scales included
    num_blocks: int  # blocks of the pool, the dummy block 0 included
    num_query_slots: int  # rows of the query cache: sequences that may compress at once
    max_model_len: int  # tokens a sequence with a KV budget may reach (prompt + output): the positions
    max_full_kv_len: int  # tokens a full-KV sequence may reach: the positions, or the pool if it holds fewer

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks a sequence's table can hold: full KV at its limit (a budgeted sequence holds fewer)."""
        return -(-self.max_full_kv_len // self.block_size)


def plan_pool(config: EngineConfig, model: ModelConfig, model_dtype) -> KVPoolPlan:
    """The pool `config` asks for on this device; ValueError when the platform cannot hold its type
    or the model's head_dim does not fit it (int4 needs a power of two of at least 64)."""
    bs = config.kvcache_block_size
    kv_heads = -(-model.num_kv_heads // config.tensor_parallel_size)
    kv_dtype = kv_quant.kv_storage_dtype(config.kv_cache_dtype, model_dtype)
    check_platform_runs(kv_dtype)
    block_bytes = kv_block_bytes(model.num_layers, bs, kv_heads, model.head_dim, kv_dtype)
    num_blocks = config.num_kvcache_blocks or int(config.kvcache_memory_gb * 2**30 // block_bytes) + 1
    usable_tokens = (num_blocks - 1) * bs
    model_len = min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    full_kv_len = min(model_len, usable_tokens)
    if full_kv_len < model_len:
        logger.warning("the KV pool holds %d tokens: full-KV requests stop there; requests with a KV budget "
                       "reach max_model_len %d", usable_tokens, model_len)
    m = config.max_cache_blocks_per_seq
    num_slots = config.max_num_seqs
    if m is not None and config.enable_hybrid_engine:
        num_slots = max(1, min(config.max_num_seqs, (num_blocks - 1) // (m + 1)))
    return KVPoolPlan(bs, np.dtype(kv_dtype), kv_heads, block_bytes, num_blocks, num_slots, model_len, full_kv_len)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype) -> int:
    """Bytes of one block of the pool, K and V of every layer, with the scales of a quantized pool
    (kv_quant.token_bytes: int8 / fp8 D + 4 bytes a token and kv head, int4 D / 2 + 2 * D / 32);
    ValueError for an int4 pool whose head_dim is not a power of two of at least 64."""
    return num_layers * block_size * 2 * num_kv_heads * kv_quant.token_bytes(head_dim, kv_dtype)


def check_platform_runs(kv_dtype) -> None:
    """ValueError when the device cannot hold this pool type (fp8 needs compute capability >= 8.9)."""
    if np.dtype(kv_dtype) != np.dtype(jnp.float8_e4m3fn) or jax.default_backend() != "gpu":
        return
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is not None and tuple(int(x) for x in str(capability).split(".")[:2]) < (8, 9):
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"this one is {capability}: use 'int8'")
