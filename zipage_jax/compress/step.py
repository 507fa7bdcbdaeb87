"""One compression step over a batch of full sequences: score, select, compact, every layer.

Padding convention (the batch is bucketed): a padding row has `num_blocks == 0` and budget 0;
its block table and target table may hold anything in range (the engine fills them with the
dummy block 0) and its query id any valid slot. Such a row keeps nothing, so it writes
nothing at all: no K/V/score/scale slot, not even in block 0.

Target tables: the first `budget / BS` entries of `target_tables[b]` receive the kept tokens
(the rest, from the block for the next token on, is not touched). A target block is either
the sequence's own block at the same index (in place) or a block the sequence does not read
(e.g. a fresh block replacing a shared prefix block), never one of its later blocks.

Quantized pools: the tokens being scored are gathered and dequantized (the scores use the
dequantized keys), and the per-token scales move with their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_quant
from pallas_kernels.compact import compact as compact_pallas
from pallas_kernels.compact import compact_reference
from pallas_kernels.kv_pool import KVPool
from zipage_jax.backend import Backend
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import CompressRows, Score
from zipage_jax.compress.scoring import ScoreStages, evicted_mass, score_layer, token_positions


def compress_layer(
    pools: KVPool,
    query_cache: jax.Array,
    block_tables: jax.Array,
    num_blocks: jax.Array,
    query_ids: jax.Array,
    compressed: jax.Array,
    target_tables: jax.Array,
    rows: CompressRows,
    cfg: CompressionConfig,
    backend: Backend = Backend.XLA,
    rope: tuple[float, ...] = (),
    window: jax.Array | int = 0,
) -> tuple[KVPool, ScoreStages]:
    """Compresses one layer; arguments as `compress` with one layer's arrays, and `window` the
    layer's sliding window in tokens (0: it attends to its whole context; a traced int32 scalar
    or an int, so one compiled program serves every layer).

    Returns (pools, stages): the stages are for inspection only.
    """
    backend = Backend.parse(backend)
    rows = most_recent_if_sliding(rows, window)
    queries = query_cache[query_ids]  # [B, QL, Hq, D]
    k_scored, v_scored, tables = _scored_tokens(pools, block_tables, queries.dtype)
    positions, position_cache = token_positions(pools.positions, block_tables, num_blocks, compressed, rows,
                                                pools.k.shape[2], pools.block_size)
    stages, score_cache = score_layer(k_scored, v_scored, queries, tables, num_blocks, compressed, pools.scores,
                                      rows, cfg, backend, cache_tables=block_tables, rope=rope, positions=positions)
    pools = pools._replace(scores=score_cache, positions=position_cache)
    present = [i for i, a in enumerate(pools) if a is not None]
    args = ([pools[i] for i in present], stages.keep, block_tables, target_tables)
    if backend.uses_pallas:
        moved = compact_pallas(*args, interpret=backend.interpret)
    else:
        moved = compact_reference(*args)
    out = list(pools)
    for i, a in zip(present, moved):
        out[i] = a
    return KVPool(*out), stages


def most_recent_if_sliding(rows: CompressRows, window: jax.Array | int) -> CompressRows:
    """A sliding-window layer's rows: scored by position with nothing protected, so each keeps
    its most recent `budget` tokens whatever its policy (the layer never reads older ones, and
    admission holds every budget to at least the window). Compaction keeps the kept tokens' slot
    order, so the layer's last `window` slots then hold its most recent `window` tokens in order.
    A full-attention layer's (window 0) rows are returned unchanged."""
    sliding = jnp.asarray(window) > 0

    def unless_sliding(field: jax.Array, value: int) -> jax.Array:
        return jnp.where(sliding, jnp.asarray(value, jnp.int32), field)

    return rows._replace(score=unless_sliding(rows.score, Score.POSITION), sinks=unless_sliding(rows.sinks, 0),
                         recent=unless_sliding(rows.recent, 0), prompt_reserve=unless_sliding(rows.prompt_reserve, 0))


def _scored_tokens(pools: KVPool, block_tables: jax.Array, dtype):
    """The keys and values scoring reads: the pools themselves, or (quantized) the sequences'
    blocks gathered and dequantized, with tables into that gathered copy."""
    if pools.k_scales is None:
        return pools.k, pools.v, block_tables
    batch, width = block_tables.shape

    def local(pool, scales):  # [B * W, BS, Hkv, D]
        x = kv_quant.dequantize(pool[block_tables], scales[block_tables], dtype)
        return x.reshape((batch * width,) + x.shape[2:])

    tables = jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width)
    return local(pools.k, pools.k_scales), local(pools.v, pools.v_scales), tables


def compress(
    layers: list[KVPool],
    query_caches: list[jax.Array],
    block_tables: jax.Array,
    num_blocks: jax.Array,
    query_ids: jax.Array,
    compressed: jax.Array,
    target_tables: jax.Array,
    rows: CompressRows,
    cfg: CompressionConfig,
    backend: Backend = Backend.XLA,
    rope: tuple[float, ...] = (),
    windows: Sequence[jax.Array | int] = (),
) -> list[KVPool]:
    """Compresses a batch of sequences in every layer (call under jax.jit, pools donated).

    Args:
      layers: per layer the pools (score cache required with use_global_score).
      query_caches: per layer [slots, QL, Hq, D].
      block_tables: [B, W] int32, each sequence's blocks (all full), padded with block 0.
      num_blocks: [B] int32 valid entries of each table; 0 marks a padding row.
      query_ids: [B] int32 query slot of each sequence.
      compressed: [B] bool, the sequence was compressed before.
      target_tables: [B, W] int32 where the kept tokens go (the first budget / BS blocks are filled).
      rows: each row's budget (tokens), protected sinks and recent tokens, and score (policy).
      cfg: static scoring options; backend: the kernels' implementation.
      rope: the model's RoPE inverse frequencies [D/2] (the "triattention" policy's score);
        empty: RoPE with theta 10,000.
      windows: per layer its sliding window in tokens, 0 for a full-attention layer (empty:
        every layer attends to its whole context). A sliding layer keeps each row's most recent
        `budget` tokens whatever the row's policy (`most_recent_if_sliding`).

    Returns:
      The layers' pools after compaction (see the module docstring).
    """
    return compress_measured(layers, query_caches, block_tables, num_blocks, query_ids, compressed, target_tables,
                             rows, cfg, backend, rope, windows)[0]


def compress_measured(layers: list[KVPool], query_caches: list[jax.Array], block_tables: jax.Array,
                      num_blocks: jax.Array, query_ids: jax.Array, compressed: jax.Array, target_tables: jax.Array,
                      rows: CompressRows, cfg: CompressionConfig, backend: Backend = Backend.XLA,
                      rope: tuple[float, ...] = (),
                      windows: Sequence[jax.Array | int] = ()) -> tuple[list[KVPool], jax.Array]:
    """`compress`, and [B, W] the attention share each row would evict keeping j blocks (column
    j), averaged over the full-attention layers and kv heads (scoring.py `evicted_mass`;
    compress/auto_budget.py).

    Sliding-window layers are left out of the average: they read only their window, which every
    budget holds, so evicting older tokens costs them nothing they would attend to. A model whose
    layers all slide measures 0 (an automatic budget then stays at its floor, the window)."""
    _check(layers, query_caches, block_tables, num_blocks, query_ids, compressed, target_tables, rows, cfg, windows)
    out, lost, num_full = [], jnp.zeros(block_tables.shape, jnp.float32), 0
    for pools, query_cache, window in zip(layers, query_caches, windows or (0,) * len(layers)):
        pools, stages = compress_layer(pools, query_cache, block_tables, num_blocks, query_ids, compressed,
                                       target_tables, rows, cfg, backend, rope, window)
        out.append(pools)
        full = jnp.asarray(window) == 0
        lost = lost + lax.cond(full, lambda final, attn: evicted_mass(final, attn, num_blocks),
                               lambda final, attn: jnp.zeros(block_tables.shape, jnp.float32),
                               stages.final, stages.attn)
        num_full = num_full + full.astype(jnp.int32)
    return out, lost / jnp.maximum(num_full, 1)


def _check(layers, query_caches, block_tables, num_blocks, query_ids, compressed, target_tables, rows,
           cfg: CompressionConfig, windows) -> None:
    if not layers:
        raise ValueError("need at least one layer")
    if len(query_caches) != len(layers):
        raise ValueError(f"need one query cache per layer, got {len(query_caches)} for {len(layers)} layers")
    if len(windows) not in (0, len(layers)):
        raise ValueError(f"need one window per layer or none, got {len(windows)} for {len(layers)} layers")
    if cfg.use_global_score and layers[0].scores is None:
        raise ValueError("use_global_score needs a score cache in every layer")
    batch = block_tables.shape[0]
    for name, x in (("num_blocks", num_blocks), ("query_ids", query_ids), ("compressed", compressed),
                    *((f"rows.{f}", getattr(rows, f)) for f in rows._fields)):
        if x.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {x.shape}")
    if compressed.dtype != jnp.bool_:
        raise ValueError(f"compressed must be bool, got {compressed.dtype}")
    if target_tables.shape != block_tables.shape:
        raise ValueError(f"target_tables must have the block tables' shape {block_tables.shape}, "
                         f"got {target_tables.shape}")
