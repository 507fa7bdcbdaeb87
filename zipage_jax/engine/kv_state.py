"""Device state the engine threads through every jitted step (always donated)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVState(NamedTuple):
    k: tuple[jax.Array, ...]  # per layer [num_blocks, BS, Hkv, D], keys after RoPE
    v: tuple[jax.Array, ...]  # per layer [num_blocks, BS, Hkv, D]
    queries: tuple[jax.Array, ...]  # per layer [slots + 1, QL, Hq, D]; the last row is padding
    scores: tuple[jax.Array, ...] | None  # per layer [num_blocks, BS, Hkv] f32 (global score)

    @classmethod
    def zeros(cls, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, num_heads: int,
              head_dim: int, num_query_slots: int, query_cache_len: int, dtype, global_score: bool) -> "KVState":
        pool = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(pool, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(pool, dtype) for _ in range(num_layers)),
            queries=tuple(jnp.zeros((num_query_slots + 1, query_cache_len, num_heads, head_dim), dtype)
                          for _ in range(num_layers)),
            scores=tuple(jnp.zeros(pool[:3], jnp.float32) for _ in range(num_layers)) if global_score else None,
        )

    def replace_layer(self, layer: int, **arrays: jax.Array) -> "KVState":
        updates = {name: _set(getattr(self, name), layer, a) for name, a in arrays.items()}
        return self._replace(**updates)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree_util.tree_leaves(self))


def _set(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1:]
