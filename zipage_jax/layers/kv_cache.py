"""The KV cache the decoder's attention threads through every step (donated by the runner)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.kv_pool import KVPool


class KVState(NamedTuple):
    pools: tuple[KVPool, ...]  # per layer, [num_blocks, BS, Hkv, ...] each
    queries: tuple[jax.Array, ...]  # per layer [slots + 1, QL, Hq, D]; the last row is padding

    @classmethod
    def zeros(cls, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, num_heads: int,
              head_dim: int, num_query_slots: int, query_cache_len: int, dtype, kv_dtype=None,
              global_score: bool) -> "KVState":
        """dtype: the model's (queries); kv_dtype: the pools' storage (default dtype); int8 or
        float8 pools get per-token scales."""
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        quantized = kv_quant.is_quantized(kv_dtype)

        def pool() -> KVPool:
            per_token = lambda: jnp.zeros(shape[:3], jnp.float32)  # noqa: E731
            return KVPool(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype),
                          k_scales=per_token() if quantized else None, v_scales=per_token() if quantized else None,
                          scores=per_token() if global_score else None)

        queries = (num_query_slots + 1, query_cache_len, num_heads, head_dim)
        return cls(pools=tuple(pool() for _ in range(num_layers)),
                   queries=tuple(jnp.zeros(queries, dtype) for _ in range(num_layers)))

    def replace_layer(self, layer: int, pool: KVPool, queries: jax.Array) -> "KVState":
        return KVState(_set(self.pools, layer, pool), _set(self.queries, layer, queries))


def _set(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1:]
