"""One layer's paged KV pool: every per-token array that lives in the blocks.

Kernels, the decoder's attention and compression all take and return this one type; the
engine's device state holds one per layer. Every array is [num_blocks, BS, Hkv, ...]: block 0
is the dummy block that padding reads and writes, and compaction moves all the arrays of a
token together. `check_paged_inputs` is the shape check every paged attention shares.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant


class KVPool(NamedTuple):
    k: jax.Array  # [NB, BS, Hkv, D] storage dtype, keys after RoPE; int4: [NB, BS, Hkv, D / 2] uint8, packed
    v: jax.Array  # [NB, BS, Hkv, D] (int4: D / 2)
    k_scales: jax.Array | None = None  # [NB, BS, Hkv] float32, quantized pools only (value = k * scale);
    #                                    int4: [NB, BS, Hkv, D / 32] float16, one per group of 32 (kv_quant)
    v_scales: jax.Array | None = None  # like k_scales
    scores: jax.Array | None = None  # [NB, BS, Hkv] float32 global score (compression with use_global_score)
    positions: jax.Array | None = None  # [NB, BS, Hkv] int32 each kept token's position (written by compression)

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def reshape_pages(self, page: int) -> "KVPool":
        """[NB, BS, ...] -> [NB * BS / page, page, ...] for every array: flat slot ids are unchanged."""
        return KVPool(*(None if a is None else a.reshape((-1, page) + a.shape[2:]) for a in self))

    def reshape_like(self, like: "KVPool") -> "KVPool":
        """The inverse of reshape_pages: every array back to `like`'s shape."""
        return KVPool(*(None if a is None else a.reshape(b.shape) for a, b in zip(self, like)))


def check_paged_inputs(q_heads: int, head_dim: int, k_pool: jax.Array, v_pool: jax.Array,
                       block_tables: jax.Array, batch: int) -> None:
    """ValueError unless the pool, the block tables and the query heads fit together."""
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [num_blocks, BS, Hkv, D], "
                         f"got {k_pool.shape} and {v_pool.shape}")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool dtypes differ: {k_pool.dtype} vs {v_pool.dtype}")
    _, _, num_kv_heads, stored_dim = k_pool.shape
    if stored_dim != kv_quant.pool_dim(head_dim, k_pool.dtype):
        raise ValueError(f"q head_dim {head_dim} does not fit a {k_pool.dtype} pool of last axis {stored_dim} "
                         f"(expected {kv_quant.pool_dim(head_dim, k_pool.dtype)})")
    if q_heads % num_kv_heads:
        raise ValueError(f"query heads {q_heads} are not a multiple of kv heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, W], got {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
