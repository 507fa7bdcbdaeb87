"""Array helpers the scoring stages share (scoring.py, score_kinds.py, redundancy.py).

Shapes as in scoring.py: B sequences, W table entries, BS block size, Hkv kv heads; a score
array is [B, Hkv, W, BS].
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def where_rows(mask: jax.Array, compute: Callable[[], jax.Array], scores: jax.Array) -> jax.Array:
    """`compute()` on the rows where `mask` [B] is set, `scores` elsewhere; `compute` runs only
    when some row needs it, so a batch without such a row pays nothing for it."""
    return lax.cond(jnp.any(mask), lambda: jnp.where(mask[:, None, None, None], compute(), scores), lambda: scores)


def slots(width: int, block_size: int) -> jax.Array:
    """[W, BS] int32 each slot's index in the table."""
    return jnp.arange(width * block_size, dtype=jnp.int32).reshape(width, block_size)


def valid_slots(num_blocks: jax.Array, width: int, block_size: int) -> jax.Array:
    """[B, 1, W, BS] bool: the slot is in one of the row's first `num_blocks` blocks."""
    w = jnp.arange(width)[None, :, None]
    valid = jnp.broadcast_to(w < num_blocks[:, None, None], (num_blocks.shape[0], width, block_size))
    return valid[:, None]


def max_normed(x: jax.Array) -> jax.Array:
    """x / its max over each (seq, head) row; all-zero (padding) rows stay 0."""
    m = x.max(axis=(-2, -1), keepdims=True)
    return x / jnp.where(m > 0, m, 1.0)
