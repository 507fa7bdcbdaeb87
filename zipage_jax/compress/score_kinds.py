"""The per-request score kinds (`policies.Score`): what a row scores before the engine-wide
stages of scoring.py, and the one that overrides them (position). R-KV's kind belongs to the
redundancy stage (redundancy.py). Each kind runs only when some row of the batch asks for it.

Shapes as in scoring.py: B sequences, W table entries, BS block size, Hkv / Hq heads, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_score import attention_score, attention_score_reference
from zipage_jax.backend import Backend
from zipage_jax.compress.future import future_attention, rope_inv_freq
from zipage_jax.compress.policies import CompressRows, Score
from zipage_jax.compress.score_ops import slots, where_rows


def observed_attention(k_pool: jax.Array, queries: jax.Array, block_tables: jax.Array, num_blocks: jax.Array,
                       rows: CompressRows, backend: Backend) -> jax.Array:
    """Step 1: the attention of the cached queries, [B, Hkv, W, BS] float32 (padding 0); all 0
    when every row is scored by position or by predicted future attention (neither reads it)."""
    def attention():
        if not backend.uses_pallas:
            return attention_score_reference(k_pool, queries, block_tables, num_blocks)
        return attention_score(k_pool, queries, block_tables, num_blocks, interpret=backend.interpret)

    shape = (block_tables.shape[0], k_pool.shape[2], block_tables.shape[1], k_pool.shape[1])
    unread = (rows.score == Score.POSITION) | (rows.score == Score.FUTURE)
    return lax.cond(jnp.all(unread), lambda: jnp.zeros(shape, jnp.float32), attention)


def row_scores(attn: jax.Array, k_pool: jax.Array, v_pool: jax.Array, queries: jax.Array, block_tables: jax.Array,
               valid: jax.Array, rows: CompressRows, rope: tuple[float, ...]) -> jax.Array:
    """Each row's score before the engine-wide stages, [B, Hkv, W, BS]: the observed attention
    `attn`; times each value's L2 norm for Score.VALUE_NORM rows; the predicted attention of
    future queries (future.py, `rope` the model's inverse frequencies) for Score.FUTURE rows."""
    scores = where_rows(rows.score == Score.VALUE_NORM, lambda: attn * value_norm(v_pool, block_tables), attn)
    inv_freq = rope_inv_freq(k_pool.shape[-1], rope)
    return where_rows(rows.score == Score.FUTURE,
                      lambda: future_attention(k_pool[block_tables], queries, valid, inv_freq), scores)


def ranked_by_position(scores: jax.Array, rows: CompressRows) -> jax.Array:
    """Score.POSITION rows score each slot by its index (later = higher), whatever the stages
    before gave them; the other rows keep `scores`."""
    width, block_size = scores.shape[-2:]
    by_position = (rows.score == Score.POSITION)[:, None, None, None]
    return jnp.where(by_position, slots(width, block_size).astype(jnp.float32), scores)


def value_norm(v_pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """L2 norm of every value in each sequence's table: [B, Hkv, W, BS] float32."""
    values = v_pool[block_tables].astype(jnp.float32)  # [B, W, BS, Hkv, D]
    return jnp.sqrt((values * values).sum(axis=-1)).transpose(0, 3, 1, 2)
