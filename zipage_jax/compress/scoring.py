"""Which tokens a full sequence keeps: docs/ALGORITHM.md section 4, per layer, batched over sequences.

Shapes: B sequences, W table entries, BS block size, T = W*BS, Hkv / Hq heads, D head dim.
A sequence's valid blocks are the first `num_blocks[b]` entries of its table (all full at
compression time, the last one newest); the rest is padding (any real block id, e.g. 0).
Each row's policy and budget are values (`CompressRows`), not compile-time options: one
compiled step compresses any mix of policies and budgets.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_score import attention_score, attention_score_reference
from zipage_jax.backend import Backend
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.future import future_attention, rope_inv_freq
from zipage_jax.compress.policies import RKV_LAMBDA, CompressRows, Score


class ScoreStages(NamedTuple):
    """Every stage of one layer's scoring, each [B, Hkv, W, BS]; None when disabled."""

    attn: jax.Array  # step 1 (padding 0; 0 for rows scored by position)
    global_score: jax.Array | None  # max_norm + step 2
    pooled: jax.Array | None  # step 3
    redundancy: jax.Array | None  # step 4 (the redundancy option), softmaxed (and max-normed), before combining
    final: jax.Array  # input of top-k, with +inf / -inf
    keep: jax.Array  # bool, rows.budget per valid (seq, head), none on padding rows


def score_layer(
    k_pool: jax.Array,
    v_pool: jax.Array,
    queries: jax.Array,
    block_tables: jax.Array,
    num_blocks: jax.Array,
    compressed: jax.Array,
    score_cache: jax.Array | None,
    rows: CompressRows,
    cfg: CompressionConfig,
    backend: Backend = Backend.XLA,
    cache_tables: jax.Array | None = None,
    rope: tuple[float, ...] = (),
    positions: jax.Array | None = None,
) -> tuple[ScoreStages, jax.Array | None]:
    """Scores one layer's tokens and picks the kept ones.

    Args:
      k_pool, v_pool: [NB, BS, Hkv, D] keys (after RoPE) and values, any float dtype (float32 math).
      queries: [B, QL, Hq, D] each sequence's cached queries.
      block_tables: [B, W] int32, padded with a real block id (never -1).
      num_blocks: [B] int32 valid table entries; 0 marks a padding row.
      compressed: [B] bool, the sequence was compressed before.
      score_cache: [NB, BS, Hkv] float32 (required with use_global_score) or None.
      rows: per-row budget (tokens kept), protected sinks and recent tokens, and Score.
      cache_tables: [B, W] the score cache's blocks when the pools are a gathered copy with tables
        of their own (quantized pools); default block_tables.
      rope: the model's RoPE inverse frequencies [D/2] for rows scored by Score.FUTURE (empty:
        RoPE with theta 10,000).
      positions: [B, Hkv, W, BS] int32 each token's position (`token_positions`), which tells the
        prompt's tokens (rows.prompt_reserve); default: the slot plus rows.position_offset.

    Returns:
      (stages, score_cache): the score cache with the new global score written into every
      valid block of every sequence (compaction then moves it with the tokens).
    """
    backend = Backend.parse(backend)
    width, block_size = block_tables.shape[1], k_pool.shape[1]
    valid = _valid(num_blocks, width, block_size)
    by_position = rows.score == Score.POSITION  # [B]
    future_rows = rows.score == Score.FUTURE
    def per_row(mask):
        return mask[:, None, None, None]

    def attention():
        if not backend.uses_pallas:
            return attention_score_reference(k_pool, queries, block_tables, num_blocks)
        return attention_score(k_pool, queries, block_tables, num_blocks, interpret=backend.interpret)

    shape = (block_tables.shape[0], k_pool.shape[2], width, block_size)
    attn = lax.cond(jnp.all(by_position | future_rows), lambda: jnp.zeros(shape, jnp.float32), attention)
    weighted = rows.score == Score.VALUE_NORM
    scores = lax.cond(jnp.any(weighted), lambda: jnp.where(
        per_row(weighted), attn * value_norm(v_pool, block_tables), attn), lambda: attn)
    inv_freq = rope_inv_freq(k_pool.shape[-1], rope)
    scores = lax.cond(jnp.any(future_rows), lambda: jnp.where(
        per_row(future_rows), future_attention(k_pool[block_tables], queries, valid, inv_freq), scores),
        lambda: scores)
    global_, pooled, red = None, None, None
    if cfg.use_global_score:
        scores, score_cache = global_score(scores, score_cache, block_tables if cache_tables is None else cache_tables,
                                           num_blocks, compressed, rows.budget // block_size, cfg)
        global_ = scores
    if cfg.enable_pooling:
        scores = pooled = max_pool(scores, compressed, cfg)
    if cfg.prompt_pooling_size > 1:
        prompt_rows = rows.in_prompt > 0
        scores = lax.cond(jnp.any(prompt_rows), lambda: jnp.where(
            per_row(prompt_rows), window_max(scores, cfg.prompt_pooling_size), scores), lambda: scores)
    if cfg.redundancy != "none":
        red = redundancy(k_pool, block_tables, num_blocks, cfg)
        if cfg.use_global_score and cfg.max_norm:
            red = _max_normed(red)
        scores = scores * cfg.redundancy_lambda - red * (1 - cfg.redundancy_lambda)
    rkv = rows.score == Score.REDUNDANCY
    scores = lax.cond(jnp.any(rkv), lambda: jnp.where(per_row(rkv), redundancy_aware(
        scores, redundancy(k_pool, block_tables, num_blocks, dataclasses.replace(cfg, redundancy="raw")), valid),
        scores), lambda: scores)
    pos = _slots(width, block_size).astype(jnp.float32)
    scores = jnp.where(per_row(by_position), pos, scores)  # later = higher
    final = protect_and_mask(scores, valid, num_blocks, rows)
    if positions is None:
        positions = _slots(width, block_size)[None, None] + rows.position_offset[:, None, None, None]
    final = lax.cond(jnp.any(rows.prompt_reserve > 0), lambda: jnp.where(
        prompt_reserve(scores, positions, valid, rows), jnp.inf, final), lambda: final)
    keep = top_k_keep(final, valid, rows.budget)
    return ScoreStages(attn, global_, pooled, red, final, keep), score_cache


def token_positions(position_cache: jax.Array | None, block_tables: jax.Array, num_blocks: jax.Array,
                    compressed: jax.Array, rows: CompressRows, num_kv_heads: int,
                    block_size: int) -> tuple[jax.Array, jax.Array | None]:
    """The position of every token of each sequence's table, [B, Hkv, W, BS] int32, and the
    position cache [NB, BS, Hkv] with them written into every valid block (compaction then
    moves them with their tokens).

    The blocks a compressed sequence kept at its last compaction (as the global score's
    history) read their positions from the cache; every other slot holds the token written
    there, at `slot + rows.position_offset` (a sequence never compressed: its slot)."""
    width = block_tables.shape[1]
    w = jnp.arange(width)
    fresh = _slots(width, block_size)[None] + rows.position_offset[:, None, None]  # [B, W, BS]
    positions = jnp.broadcast_to(fresh[:, None], (block_tables.shape[0], num_kv_heads, width, block_size))
    if position_cache is None:
        return positions, None
    history = jnp.minimum(rows.budget // block_size, num_blocks - 1)
    use_history = compressed[:, None] & (w[None, :] < history[:, None])  # [B, W]
    cached = position_cache[block_tables].transpose(0, 3, 1, 2)  # [B, Hkv, W, BS]
    positions = jnp.where(use_history[:, None, :, None], cached, positions)
    dest = jnp.where(w[None, :] < num_blocks[:, None], block_tables, position_cache.shape[0])  # out of range: dropped
    return positions, position_cache.at[dest].set(positions.transpose(0, 2, 3, 1), mode="drop")


def prompt_reserve(scores: jax.Array, positions: jax.Array, valid: jax.Array, rows: CompressRows) -> jax.Array:
    """The prompt reserve: each row's `rows.prompt_reserve` best prompt tokens, [B, Hkv, W, BS]
    bool: its sinks, then the tokens the answer has not quoted yet (positions >= rows.quote_end),
    then the others, each group best-scored first. The prompt keeps them whatever the generated
    tokens score."""
    width, block_size = scores.shape[-2:]
    def as_row(x):
        return x[:, None, None, None]
    is_prompt = valid & (positions < as_row(rows.prompt_len))
    group = jnp.where(_slots(width, block_size) < as_row(rows.sinks), 2,
                      (positions >= as_row(rows.quote_end)).astype(jnp.int32))  # sinks, unquoted, quoted
    return top_k_keep(jnp.where(is_prompt, scores, -jnp.inf), is_prompt, rows.prompt_reserve, group)


def redundancy_aware(attn: jax.Array, red: jax.Array, valid: jax.Array) -> jax.Array:
    """R-KV's score: RKV_LAMBDA * importance - (1 - RKV_LAMBDA) * redundancy, the importance
    (attention, [B, Hkv, W, BS]) normalised to sum 1 over each row's valid tokens like the
    softmaxed redundancy `red`."""
    importance = jnp.where(valid, attn, 0.0)
    total = importance.sum(axis=(-2, -1), keepdims=True)
    importance = importance / jnp.where(total > 0, total, 1.0)
    return RKV_LAMBDA * importance - (1 - RKV_LAMBDA) * red


def value_norm(v_pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """L2 norm of every value in each sequence's table: [B, Hkv, W, BS] float32."""
    values = v_pool[block_tables].astype(jnp.float32)  # [B, W, BS, Hkv, D]
    return jnp.sqrt((values * values).sum(axis=-1)).transpose(0, 3, 1, 2)


def protect_and_mask(scores: jax.Array, valid: jax.Array, num_blocks: jax.Array, rows: CompressRows) -> jax.Array:
    """Steps 5-7 before top-k: each row's sinks and recent window +inf, padding -inf.

    scores: [B, Hkv, W, BS]; valid: [B, 1, W, BS] bool; num_blocks: [B] (all valid blocks full).
    """
    width, block_size = scores.shape[-2:]
    pos = jnp.arange(width * block_size).reshape(width, block_size)  # [W, BS]
    length = num_blocks * block_size
    def as_row(x):
        return x[:, None, None, None]
    protected = (pos < as_row(rows.sinks)) | (pos >= as_row(length - rows.recent))
    scores = jnp.where(protected, jnp.inf, scores)
    return jnp.where(valid, scores, -jnp.inf)


def global_score(
    scores: jax.Array,
    score_cache: jax.Array,
    block_tables: jax.Array,
    num_blocks: jax.Array,
    compressed: jax.Array,
    history_blocks: jax.Array,
    cfg: CompressionConfig,
) -> tuple[jax.Array, jax.Array]:
    """Step 2: `max(score, decay * history)` over the blocks a compressed sequence kept at its
    last compaction (`history_blocks` [B], its budget in blocks); the blocks written since (one
    in decode, a prefill chunk's in prefill) are scored afresh."""
    if score_cache is None:
        raise ValueError("use_global_score needs a score cache")
    num_kv_blocks = score_cache.shape[0]
    width = block_tables.shape[1]
    if cfg.max_norm:
        scores = _max_normed(scores)
    history = score_cache[block_tables].transpose(0, 3, 1, 2)  # [B, Hkv, W, BS]
    w = jnp.arange(width)
    use_history = compressed[:, None] & (w[None, :] < jnp.minimum(history_blocks, num_blocks - 1)[:, None])  # [B, W]
    decayed = jnp.maximum(scores, history * cfg.decay_factor)
    scores = jnp.where(use_history[:, None, :, None], decayed, scores)
    dest = jnp.where(w[None, :] < num_blocks[:, None], block_tables, num_kv_blocks)  # out of range: dropped
    score_cache = score_cache.at[dest].set(scores.transpose(0, 2, 3, 1), mode="drop")
    return scores, score_cache


def max_pool(scores: jax.Array, compressed: jax.Array, cfg: CompressionConfig) -> jax.Array:
    """Step 3: max pooling along the whole table row (stride 1, same padding)."""
    pooled = window_max(scores, cfg.pooling_size)
    if cfg.continues_pooling:
        return pooled
    return jnp.where(compressed[:, None, None, None], scores, pooled)


def window_max(scores: jax.Array, size: int) -> jax.Array:
    """The max over a window of `size` slots centred on each slot of a table row, [B, Hkv, W, BS]."""
    batch, num_kv_heads, width, block_size = scores.shape
    flat = scores.reshape(batch, num_kv_heads, width * block_size)
    return lax.reduce_window(
        flat, -jnp.inf, lax.max, (1, 1, size), (1, 1, 1), ((0, 0), (0, 0), (size // 2, size // 2))
    ).reshape(scores.shape)


def redundancy(
    k_pool: jax.Array, block_tables: jax.Array, num_blocks: jax.Array, cfg: CompressionConfig
) -> jax.Array:
    """Step 4: softmax over the sequence of each key's (R-KV style) redundancy.

    Cosine similarity between keys with the diagonal zeroed; for every key column, the row
    of largest index among those above the threshold has its entry zeroed; row sums are the
    logits. "lightning": keys of the same block only, logits / (temperature * BS); "raw":
    the whole sequence, logits / (temperature * T_valid).
    """
    width, block_size = block_tables.shape[1], k_pool.shape[1]
    keys = k_pool[block_tables].astype(jnp.float32)  # [B, W, BS, Hkv, D]
    norm = jnp.sqrt((keys * keys).sum(axis=-1, keepdims=True))
    keys = (keys / jnp.maximum(norm, 1e-6)).transpose(0, 3, 1, 2, 4)  # [B, Hkv, W, BS, D]
    valid = _valid(num_blocks, width, block_size)  # [B, 1, W, BS]
    if cfg.redundancy == "lightning":
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


def evicted_mass(final: jax.Array, attn: jax.Array, num_blocks: jax.Array) -> jax.Array:
    """[B, W] the attention share evicted by keeping j blocks' worth of tokens (column j), per
    row averaged over kv heads; 1 at j = 0, 0 from j = num_blocks on (everything kept).

    final: [B, Hkv, W, BS] the policy's ranking (+inf protected, -inf padding);
    attn: [B, Hkv, W, BS] the cached queries' attention to each token (0 on padding)."""
    batch, heads, width, block_size = final.shape
    order = jnp.argsort(-final.reshape(batch, heads, -1), axis=-1, stable=True)
    ranked = jnp.take_along_axis(attn.reshape(batch, heads, -1), order, axis=-1)
    kept = jnp.cumsum(ranked, axis=-1)  # [B, Hkv, T] attention of the best t + 1
    total = kept[..., -1:]
    at_blocks = jnp.concatenate([jnp.zeros_like(total), kept[..., block_size - 1::block_size][..., :width - 1]], -1)
    lost = jnp.where(total > 0, 1.0 - at_blocks / jnp.where(total > 0, total, 1.0), 0.0)
    lost = jnp.where(jnp.arange(width)[None, None] >= num_blocks[:, None, None], 0.0, lost)
    return jnp.clip(lost, 0.0, 1.0).mean(axis=1)


def top_k_keep(final: jax.Array, valid: jax.Array, k: jax.Array, group: jax.Array | None = None) -> jax.Array:
    """Step 7: the k[b] best tokens of every (seq, head), never padding: [B, Hkv, W, BS] bool.

    k is a per-row value: the kept set is the first k of a stable descending sort; with `group`
    (int, broadcastable to `final`) the higher group first, by score within it."""
    batch, num_kv_heads, width, block_size = final.shape
    scores = -final.reshape(batch, num_kv_heads, -1)
    if group is None:
        order = jnp.argsort(scores, axis=-1, stable=True)  # [B, Hkv, T]
    else:
        order = jnp.lexsort((scores, -jnp.broadcast_to(group, final.shape).reshape(scores.shape)), axis=-1)
    b = jnp.arange(batch)[:, None, None]
    h = jnp.arange(num_kv_heads)[None, :, None]
    rank = jnp.zeros_like(order).at[b, h, order].set(jnp.arange(order.shape[-1], dtype=order.dtype))
    return (rank < k[:, None, None]).reshape(final.shape) & valid


def _slots(width, block_size):  # [W, BS] each slot's index in the table
    return jnp.arange(width * block_size, dtype=jnp.int32).reshape(width, block_size)


def _valid(num_blocks, width, block_size):  # [B, 1, W, BS]
    w = jnp.arange(width)[None, :, None]
    valid = jnp.broadcast_to(w < num_blocks[:, None, None], (num_blocks.shape[0], width, block_size))
    return valid[:, None]


def _max_normed(x):
    """x / its max over each (seq, head) row; all-zero (padding) rows stay 0."""
    m = x.max(axis=(-2, -1), keepdims=True)
    return x / jnp.where(m > 0, m, 1.0)


def _masked_softmax(logits, valid):
    """Softmax over each (seq, head) row's valid tokens; 0 elsewhere (all 0 on padding rows)."""
    m = jnp.where(valid, logits, -jnp.inf).max(axis=(-2, -1), keepdims=True)
    e = jnp.where(valid, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(axis=(-2, -1), keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)
