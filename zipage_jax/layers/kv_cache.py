"""The KV cache the decoder's attention threads through every step (donated by the runner)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant


class KVState(NamedTuple):
    k: tuple[jax.Array, ...]  # per layer [num_blocks, BS, Hkv, D] storage dtype, keys after RoPE
    v: tuple[jax.Array, ...]  # per layer [num_blocks, BS, Hkv, D]
    queries: tuple[jax.Array, ...]  # per layer [slots + 1, QL, Hq, D]; the last row is padding
    scores: tuple[jax.Array, ...] | None  # per layer [num_blocks, BS, Hkv] f32 (global score)
    k_scales: tuple[jax.Array, ...] | None = None  # per layer [num_blocks, BS, Hkv] f32 (quantized pools)
    v_scales: tuple[jax.Array, ...] | None = None

    @classmethod
    def zeros(cls, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, num_heads: int,
              head_dim: int, num_query_slots: int, query_cache_len: int, dtype, kv_dtype=None,
              global_score: bool) -> "KVState":
        """dtype: the model's (queries); kv_dtype: the pools' storage (default dtype); int8 or
        float8 pools get per-token scales."""
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        pool = (num_blocks, block_size, num_kv_heads, head_dim)
        quantized = kv_quant.is_quantized(kv_dtype)
        per_token = lambda: tuple(jnp.zeros(pool[:3], jnp.float32) for _ in range(num_layers))  # noqa: E731
        return cls(
            k=tuple(jnp.zeros(pool, kv_dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(pool, kv_dtype) for _ in range(num_layers)),
            queries=tuple(jnp.zeros((num_query_slots + 1, query_cache_len, num_heads, head_dim), dtype)
                          for _ in range(num_layers)),
            scores=per_token() if global_score else None,
            k_scales=per_token() if quantized else None,
            v_scales=per_token() if quantized else None,
        )

    def replace_layer(self, layer: int, **arrays: jax.Array) -> "KVState":
        updates = {name: _set(getattr(self, name), layer, a) for name, a in arrays.items() if a is not None}
        return self._replace(**updates)


def _set(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1:]
