"""Which tokens a full sequence keeps: docs/ALGORITHM.md section 4, per layer, batched over sequences.

Shapes: B sequences, W table entries, BS block size, T = W*BS, Hkv / Hq heads, D head dim.
A sequence's valid blocks are the first `num_blocks[b]` entries of its table (all full at
compression time, the last one newest); the rest is padding (any real block id, e.g. 0).
Each row's policy and budget are values (`CompressRows`), not compile-time options: one
compiled step compresses any mix of policies and budgets.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zipage_jax.backend import Backend
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import CompressRows
from zipage_jax.compress.redundancy import redundancy_stage
from zipage_jax.compress.score_kinds import observed_attention, ranked_by_position, row_scores
from zipage_jax.compress.score_ops import max_normed, slots, valid_slots, where_rows


class ScoreStages(NamedTuple):
    """Every stage of one layer's scoring, each [B, Hkv, W, BS]; None when disabled."""

    attn: jax.Array  # step 1 (padding 0; 0 for rows scored by position)
    global_score: jax.Array | None  # max_norm + step 2
    pooled: jax.Array | None  # step 3
    redundancy: jax.Array | None  # step 4 (the redundancy option), softmaxed (and max-normed), before combining
    final: jax.Array  # input of top-k, with +inf / -inf
    keep: jax.Array  # bool, rows.budget per valid (seq, head), none on padding rows


def score_layer(
    k_pool: jax.Array, v_pool: jax.Array, queries: jax.Array, block_tables: jax.Array, num_blocks: jax.Array,
    compressed: jax.Array, score_cache: jax.Array | None, rows: CompressRows, cfg: CompressionConfig,
    backend: Backend = Backend.XLA, cache_tables: jax.Array | None = None, rope: tuple[float, ...] = (),
    positions: jax.Array | None = None,
) -> tuple[ScoreStages, jax.Array | None]:
    """Scores one layer's tokens and picks the kept ones: each row's score kind (score_kinds.py),
    the engine-wide stages (`cfg`: global score, pooling, redundancy.py), then selection.

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
    width, block_size = block_tables.shape[1], k_pool.shape[1]
    valid = valid_slots(num_blocks, width, block_size)
    attn = observed_attention(k_pool, queries, block_tables, num_blocks, rows, Backend.parse(backend))
    scores = row_scores(attn, k_pool, v_pool, queries, block_tables, valid, rows, rope)
    global_ = None
    if cfg.use_global_score:
        scores, score_cache = global_score(scores, score_cache, block_tables if cache_tables is None else cache_tables,
                                           num_blocks, compressed, rows, cfg)
        global_ = scores
    scores, pooled = pooling_stages(scores, compressed, rows, cfg)
    scores, red = redundancy_stage(scores, k_pool, block_tables, num_blocks, valid, rows, cfg)
    scores = ranked_by_position(scores, rows)
    if positions is None:
        positions = slots(width, block_size)[None, None] + rows.position_offset[:, None, None, None]
    final, keep = select(scores, valid, num_blocks, positions, rows)
    return ScoreStages(attn, global_, pooled, red, final, keep), score_cache


def pooling_stages(scores: jax.Array, compressed: jax.Array, rows: CompressRows,
                   cfg: CompressionConfig) -> tuple[jax.Array, jax.Array | None]:
    """Step 3: the scores after max pooling (`enable_pooling`, `max_pool`) and, for rows
    compacting inside their prompt, the prompt's wider pooling (`prompt_pooling_size`); and the
    max-pooled scores (None when `enable_pooling` is off)."""
    pooled = None
    if cfg.enable_pooling:
        scores = pooled = max_pool(scores, compressed, cfg)
    if cfg.prompt_pooling_size > 1:
        scores = where_rows(rows.in_prompt > 0, lambda: window_max(scores, cfg.prompt_pooling_size), scores)
    return scores, pooled


def select(scores: jax.Array, valid: jax.Array, num_blocks: jax.Array, positions: jax.Array,
           rows: CompressRows) -> tuple[jax.Array, jax.Array]:
    """Steps 5-7: (final, keep), the ranking top-k reads (each row's sinks, recent window and
    prompt reserve +inf, padding -inf) and the `rows.budget` best tokens of each (seq, head)."""
    final = protect_and_mask(scores, valid, num_blocks, rows)
    final = where_rows(rows.prompt_reserve > 0,
                       lambda: jnp.where(prompt_reserve(scores, positions, valid, rows), jnp.inf, final), final)
    return final, top_k_keep(final, valid, rows.budget)


def token_positions(position_cache: jax.Array | None, block_tables: jax.Array, num_blocks: jax.Array,
                    compressed: jax.Array, rows: CompressRows, num_kv_heads: int,
                    block_size: int) -> tuple[jax.Array, jax.Array | None]:
    """The position of every token of each sequence's table, [B, Hkv, W, BS] int32, and the
    position cache [NB, BS, Hkv] with them written into every valid block (compaction then
    moves them with their tokens).

    The blocks a compressed sequence kept at its last compaction (`rows.history`, as the global
    score's history) read their positions from the cache; every other slot holds the token written
    there, at `slot + rows.position_offset` (a sequence never compressed: its slot)."""
    width = block_tables.shape[1]
    fresh = slots(width, block_size)[None] + rows.position_offset[:, None, None]  # [B, W, BS]
    positions = jnp.broadcast_to(fresh[:, None], (block_tables.shape[0], num_kv_heads, width, block_size))
    if position_cache is None:
        return positions, None
    use_history = history_mask(compressed, rows, num_blocks, width)
    cached = position_cache[block_tables].transpose(0, 3, 1, 2)  # [B, Hkv, W, BS]
    positions = jnp.where(use_history[:, None, :, None], cached, positions)
    dest = cache_destinations(block_tables, num_blocks, rows.budget, position_cache.shape[0], block_size)
    return positions, position_cache.at[dest].set(positions.transpose(0, 2, 3, 1), mode="drop")


def history_mask(compressed: jax.Array, rows: CompressRows, num_blocks: jax.Array, width: int) -> jax.Array:
    """[B, W] the table columns whose tokens a compressed sequence kept at its last compaction
    (`rows.history` blocks, never its newest block): their cached score and position are theirs."""
    history = jnp.minimum(rows.history, num_blocks - 1)
    return compressed[:, None] & (jnp.arange(width)[None, :] < history[:, None])


def cache_destinations(block_tables: jax.Array, num_blocks: jax.Array, budget: jax.Array, num_cache_blocks: int,
                       block_size: int) -> jax.Array:
    """[B, W] where a compaction writes each row's per-token caches (global score, positions)
    before it moves them with the tokens: its valid blocks; nowhere (`num_cache_blocks`, out of
    range, dropped) for padding and for a row whose `budget` (tokens) holds every token, an
    automatic budget's measurement, so that measuring leaves the caches as they were."""
    w = jnp.arange(block_tables.shape[1])
    writes = (w[None, :] < num_blocks[:, None]) & (budget < num_blocks * block_size)[:, None]
    return jnp.where(writes, block_tables, num_cache_blocks)


def prompt_reserve(scores: jax.Array, positions: jax.Array, valid: jax.Array, rows: CompressRows) -> jax.Array:
    """The prompt reserve: each row's `rows.prompt_reserve` best prompt tokens, [B, Hkv, W, BS]
    bool: its sinks, then the tokens the answer has not quoted yet (positions >= rows.quote_end),
    then the others, each group best-scored first. The prompt keeps them whatever the generated
    tokens score."""
    width, block_size = scores.shape[-2:]
    def as_row(x):
        return x[:, None, None, None]
    is_prompt = valid & (positions < as_row(rows.prompt_len))
    group = jnp.where(slots(width, block_size) < as_row(rows.sinks), 2,
                      (positions >= as_row(rows.quote_end)).astype(jnp.int32))  # sinks, unquoted, quoted
    return top_k_keep(jnp.where(is_prompt, scores, -jnp.inf), is_prompt, rows.prompt_reserve, group)


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
    rows: CompressRows,
    cfg: CompressionConfig,
) -> tuple[jax.Array, jax.Array]:
    """Step 2: `max(score, decay * history)` over the blocks a compressed sequence kept at its
    last compaction (`rows.history`); the blocks written since (one in decode, a prefill chunk's
    in prefill, an automatic budget's growth) are scored afresh."""
    if score_cache is None:
        raise ValueError("use_global_score needs a score cache")
    num_kv_blocks, block_size = score_cache.shape[:2]
    width = block_tables.shape[1]
    if cfg.max_norm:
        scores = max_normed(scores)
    history = score_cache[block_tables].transpose(0, 3, 1, 2)  # [B, Hkv, W, BS]
    use_history = history_mask(compressed, rows, num_blocks, width)
    decayed = jnp.maximum(scores, history * cfg.decay_factor)
    scores = jnp.where(use_history[:, None, :, None], decayed, scores)
    dest = cache_destinations(block_tables, num_blocks, rows.budget, num_kv_blocks, block_size)
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
