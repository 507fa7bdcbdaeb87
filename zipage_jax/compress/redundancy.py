"""Step 4 of docs/ALGORITHM.md section 4, the redundancy of keys, and the one place that decides
which redundancy each row's score subtracts (`redundancy_stage`).

Shapes as in scoring.py: B sequences, W table entries, BS block size, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from zipage_jax.compress.config import CompressionConfig, Redundancy
from zipage_jax.compress.policies import RKV_LAMBDA, CompressRows, Score
from zipage_jax.compress.score_ops import max_normed, where_rows


def redundancy_stage(scores: jax.Array, k_pool: jax.Array, block_tables: jax.Array, num_blocks: jax.Array,
                     valid: jax.Array, rows: CompressRows,
                     cfg: CompressionConfig) -> tuple[jax.Array, jax.Array | None]:
    """The scores [B, Hkv, W, BS] less each row's redundancy, and the engine-wide redundancy
    (None when `cfg.redundancy` is "none").

    Every row subtracts the engine's redundancy (`cfg.redundancy`, divided by its maximum under
    `max_norm` with the global score): `score * lambda - r * (1 - lambda)`. A row scored by
    Score.REDUNDANCY (R-KV) then combines that score with the whole-sequence ("raw") redundancy:
    `redundancy_aware`."""
    red = None
    if cfg.redundancy != "none":
        red = redundancy(k_pool, block_tables, num_blocks, valid, cfg.redundancy, cfg)
        if cfg.use_global_score and cfg.max_norm:
            red = max_normed(red)
        scores = scores * cfg.redundancy_lambda - red * (1 - cfg.redundancy_lambda)
    rkv = rows.score == Score.REDUNDANCY
    scores = where_rows(rkv, lambda: redundancy_aware(
        scores, redundancy(k_pool, block_tables, num_blocks, valid, "raw", cfg), valid), scores)
    return scores, red


def redundancy_aware(attn: jax.Array, red: jax.Array, valid: jax.Array) -> jax.Array:
    """R-KV's score: RKV_LAMBDA * importance - (1 - RKV_LAMBDA) * redundancy, the importance
    (attention, [B, Hkv, W, BS]) normalised to sum 1 over each row's valid tokens like the
    softmaxed redundancy `red`."""
    importance = jnp.where(valid, attn, 0.0)
    total = importance.sum(axis=(-2, -1), keepdims=True)
    importance = importance / jnp.where(total > 0, total, 1.0)
    return RKV_LAMBDA * importance - (1 - RKV_LAMBDA) * red


def redundancy(k_pool: jax.Array, block_tables: jax.Array, num_blocks: jax.Array, valid: jax.Array,
               kind: Redundancy, cfg: CompressionConfig) -> jax.Array:
    """Softmax over the sequence of each key's (R-KV style) redundancy, [B, Hkv, W, BS].

    Cosine similarity between keys with the diagonal zeroed; for every key column, the row
    of largest index among those above the threshold has its entry zeroed; row sums are the
    logits. `kind` "lightning": keys of the same block only, logits / (temperature * BS);
    "raw": the whole sequence, logits / (temperature * T_valid). `cfg` gives the threshold and
    the temperature; `valid` is [B, 1, W, BS] (score_ops.valid_slots).
    """
    block_size = k_pool.shape[1]
    keys = k_pool[block_tables].astype(jnp.float32)  # [B, W, BS, Hkv, D]
    norm = jnp.sqrt((keys * keys).sum(axis=-1, keepdims=True))
    keys = (keys / jnp.maximum(norm, 1e-6)).transpose(0, 3, 1, 2, 4)  # [B, Hkv, W, BS, D]
    if kind == "lightning":
        sim = jnp.einsum("bhwmd,bhwnd->bhwmn", keys, keys, precision=lax.Precision.HIGHEST)
        local = jnp.arange(block_size)
        logits = _redundancy_row_sums(sim, local[:, None], local[None, :], cfg.redundancy_threshold)
        logits = logits / (cfg.redundancy_temperature * block_size)
    else:
        logits = _raw_row_sums(keys, valid, cfg.redundancy_threshold)
        length = (num_blocks * block_size).astype(jnp.float32)[:, None, None, None]
        logits = logits / (cfg.redundancy_temperature * length)
    return _masked_softmax(logits, valid)


def _redundancy_row_sums(sim, rows, cols, threshold, allowed=None):
    """Row sums of `sim` [..., m, n] after the diagonal and largest-index zeroing."""
    sim = jnp.where(rows == cols, 0.0, sim)
    above = sim > threshold
    if allowed is not None:
        above = above & allowed
    rows = jnp.broadcast_to(rows, sim.shape)
    last = jnp.where(above, rows, -1).max(axis=-2, keepdims=True)  # per column n
    return jnp.where(rows == last, 0.0, sim).sum(axis=-1)


def _raw_row_sums(keys, valid, threshold):
    """Whole-sequence row sums, one column block at a time: [B, Hkv, W, BS]."""
    batch, num_kv_heads, width, block_size, head_dim = keys.shape
    flat = keys.reshape(batch, num_kv_heads, width * block_size, head_dim)  # [B, Hkv, T, D]
    flat_valid = valid.reshape(batch, 1, width * block_size)
    rows = jnp.arange(width * block_size)[:, None]

    def column_block(c):  # [B, Hkv, T] contributions of columns c*BS .. (c+1)*BS-1
        cols_keys = lax.dynamic_index_in_dim(keys, c, axis=2, keepdims=False)  # [B, Hkv, BS, D]
        cols_valid = lax.dynamic_index_in_dim(valid, c, axis=2, keepdims=False)  # [B, 1, BS]
        sim = jnp.einsum("bhmd,bhnd->bhmn", flat, cols_keys, precision=lax.Precision.HIGHEST)
        pair_valid = flat_valid[..., :, None] & cols_valid[..., None, :]
        sim = jnp.where(pair_valid, sim, 0.0)
        cols = c * block_size + jnp.arange(block_size)[None, :]
        return _redundancy_row_sums(sim, rows, cols, threshold, pair_valid)

    sums = lax.map(column_block, jnp.arange(width)).sum(axis=0)
    return sums.reshape(batch, num_kv_heads, width, block_size)


def _masked_softmax(logits, valid):
    """Softmax over each (seq, head) row's valid tokens; 0 elsewhere (all 0 on padding rows)."""
    m = jnp.where(valid, logits, -jnp.inf).max(axis=(-2, -1), keepdims=True)
    e = jnp.where(valid, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(axis=(-2, -1), keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)
