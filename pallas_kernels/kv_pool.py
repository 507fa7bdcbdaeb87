"""One layer's paged KV pool: every per-token array that lives in the blocks.

Kernels, the decoder's attention and compression all take and return this one type; the
engine's device state holds one per layer. Every array is [num_blocks, BS, Hkv, ...]: block 0
is the dummy block that padding reads and writes, and compaction moves all the arrays of a
token together.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


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

