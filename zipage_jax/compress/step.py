"""One compression step over a batch of full sequences: score, select, compact, every layer.

Padding convention (the batch is bucketed): a padding row has `num_blocks == 0`; its
block table and target table may hold anything in range (the engine fills them with the
dummy block 0) and its query id any valid slot. Such a row keeps nothing, so it writes
nothing at all: no K/V/score-cache slot, not even in block 0.

Target tables: `target_tables[b, :M]` receive the kept tokens (M = cfg.budget_blocks; the
last column, the block for the next token, is not touched). A target block is either the
sequence's own block at the same index (in-place) or a block the sequence does not read
(e.g. a fresh block replacing a shared prefix block), never one of its later blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.compact import compact as compact_pallas
from pallas_kernels.compact import compact_reference
from zipage_jax.compress.scoring import BACKENDS, ScoreStages, score_layer
from zipage_jax.config import CompressionConfig


def compress_layer(
    k_pool: jax.Array,
    v_pool: jax.Array,
    score_cache: jax.Array | None,
    query_cache: jax.Array,
    block_tables: jax.Array,
    num_blocks: jax.Array,
    query_ids: jax.Array,
    compressed: jax.Array,
    target_tables: jax.Array,
    cfg: CompressionConfig,
    backend: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array | None, ScoreStages]:
    """Compresses one layer; arguments as `compress` with one layer's arrays.

    Returns (k_pool, v_pool, score_cache, stages): the stages are for inspection only.
    """
    queries = query_cache[query_ids]  # [B, QL, Hq, D]
    stages, score_cache = score_layer(
        k_pool, queries, block_tables, num_blocks, compressed, score_cache, cfg, backend, v_pool
    )
    targets = target_tables[:, : cfg.budget_blocks]
    pools = [k_pool, v_pool] + ([] if score_cache is None else [score_cache])
    if backend == "xla":
        pools = compact_reference(pools, stages.keep, block_tables, targets)
    else:
        pools = compact_pallas(pools, stages.keep, block_tables, targets,
                               interpret=backend == "pallas-interpret")
    k_pool, v_pool, score_cache = pools[0], pools[1], (pools[2] if score_cache is not None else None)
    return k_pool, v_pool, score_cache, stages


def compress(
    k_pools: list[jax.Array],
    v_pools: list[jax.Array],
    score_caches: list[jax.Array] | None,
    query_caches: list[jax.Array],
    block_tables: jax.Array,
    num_blocks: jax.Array,
    query_ids: jax.Array,
    compressed: jax.Array,
    target_tables: jax.Array,
    cfg: CompressionConfig,
    backend: str = "xla",
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array] | None]:
    """Compresses a batch of sequences in every layer (call under jax.jit, pools donated).

    Args:
      k_pools, v_pools: per layer [NB, BS, Hkv, D].
      score_caches: per layer [NB, BS, Hkv] float32, or None (required with use_global_score).
      query_caches: per layer [slots, QL, Hq, D].
      block_tables: [B, W] int32, each sequence's blocks (all full), padded with block 0.
      num_blocks: [B] int32 valid entries of each table; 0 marks a padding row.
      query_ids: [B] int32 query slot of each sequence.
      compressed: [B] bool, the sequence was compressed before.
      target_tables: [B, M + 1] int32 where the kept tokens go (first M blocks are filled).
      cfg: static compression options; backend: "xla", "pallas" or "pallas-interpret".

    Returns:
      (k_pools, v_pools, score_caches) after compaction; see the module docstring for the
      padding convention and which target blocks are allowed.
    """
    _check(k_pools, v_pools, score_caches, query_caches, block_tables, num_blocks, query_ids, compressed,
           target_tables, cfg, backend)
    out_k, out_v, out_s = [], [], []
    for layer, (k_pool, v_pool, query_cache) in enumerate(zip(k_pools, v_pools, query_caches)):
        score_cache = None if score_caches is None else score_caches[layer]
        k_pool, v_pool, score_cache, _ = compress_layer(
            k_pool, v_pool, score_cache, query_cache, block_tables, num_blocks, query_ids, compressed,
            target_tables, cfg, backend,
        )
        out_k.append(k_pool)
        out_v.append(v_pool)
        out_s.append(score_cache)
    return out_k, out_v, (None if score_caches is None else out_s)


def _check(k_pools, v_pools, score_caches, query_caches, block_tables, num_blocks, query_ids, compressed,
           target_tables, cfg: CompressionConfig, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    num_layers = len(k_pools)
    if num_layers == 0:
        raise ValueError("need at least one layer")
    if len(v_pools) != num_layers or len(query_caches) != num_layers:
        raise ValueError(f"need one k pool, v pool and query cache per layer, got "
                         f"{num_layers}, {len(v_pools)}, {len(query_caches)}")
    if score_caches is not None and len(score_caches) != num_layers:
        raise ValueError(f"need one score cache per layer, got {len(score_caches)} "
                         f"for {num_layers} layers")
    if cfg.use_global_score and cfg.eviction_policy != "streaming" and score_caches is None:
        raise ValueError("use_global_score needs score_caches")
    block_size = k_pools[0].shape[1]
    if block_size != cfg.block_size:
        raise ValueError(f"pool block size {block_size} != cfg.block_size {cfg.block_size}")
    if query_caches[0].shape[1] != cfg.query_cache_len:
        raise ValueError(f"query cache length {query_caches[0].shape[1]} "
                         f"!= cfg.query_cache_len {cfg.query_cache_len}")
    batch = block_tables.shape[0]
    for name, x in (("num_blocks", num_blocks), ("query_ids", query_ids), ("compressed", compressed)):
        if x.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {x.shape}")
    if compressed.dtype != jnp.bool_:
        raise ValueError(f"compressed must be bool, got {compressed.dtype}")
    if target_tables.shape != (batch, cfg.budget_blocks + 1):
        raise ValueError(f"target_tables must have shape ({batch}, {cfg.budget_blocks + 1}), "
                         f"got {target_tables.shape}")
