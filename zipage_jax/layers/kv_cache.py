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
        """dtype: the model's (queries); kv_dtype: the pools' storage (default dtype); quantized
        pools get their scales (kv_quant: per token for int8 / float8, per token and group of 32
        for int4, whose pools hold head_dim / 2 bytes)."""
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        shape = (num_blocks, block_size, num_kv_heads, kv_quant.pool_dim(head_dim, kv_dtype))  # [NB, BS, Hkv, Dp]
        quantized = kv_quant.is_quantized(kv_dtype)

        scales_shape, scales_dtype = kv_quant.scales_shape(shape, kv_dtype), kv_quant.scales_dtype(kv_dtype)

        def scales() -> jax.Array | None:  # [NB, BS, Hkv] float32, or [NB, BS, Hkv, D / 32] float16 (int4)
            return jnp.zeros(scales_shape, scales_dtype) if quantized else None

        def pool() -> KVPool:
            return KVPool(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype), k_scales=scales(),
                          v_scales=scales(), scores=jnp.zeros(shape[:3], jnp.float32) if global_score else None,
                          positions=jnp.zeros(shape[:3], jnp.int32))

        queries = (num_query_slots + 1, query_cache_len, num_heads, head_dim)
        return cls(pools=tuple(pool() for _ in range(num_layers)),
                   queries=tuple(jnp.zeros(queries, dtype) for _ in range(num_layers)))

    def replace_layer(self, layer: int, pool: KVPool, queries: jax.Array) -> "KVState":
        return KVState(_set(self.pools, layer, pool), _set(self.queries, layer, queries))


def _set(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1:]
