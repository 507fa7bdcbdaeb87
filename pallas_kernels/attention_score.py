"""Attention of a sequence's cached queries over its KV pages (Zipage scoring, step 1).

For every (sequence, kv head) and every token of the sequence: softmax over all tokens of
`q . k * D^-0.5` for each of the QL cached queries and each query head of the group, the
max over the G query heads, then the mean over the QL queries. Query `i` sits at in-block
offset `BS - QL + i` of the newest block and does not see the keys after it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_MIN_DOT_ROWS = 16  # Triton's dot wants M >= 16


def _attention_score_kernel(
    # inputs
    q_ref,  # [G, QLp, D] cached queries of one kv head's group, rows >= QL are padding
    tables_ref,  # [W] physical block of each logical block
    num_blocks_ref,  # [1] valid entries of tables_ref; the last one is the newest block
    k_ref,  # [NB, BS, D] the whole key pool of this kv head
    # outputs
    o_ref,  # [W, BS] score of every token, 0 past num_blocks
    *,
    query_len: int,
):
    num_groups, qlp, head_dim = q_ref.shape
    num_pages, block_size = o_ref.shape
    scale = head_dim**-0.5
    n = num_blocks_ref[0]
    rows = lax.broadcasted_iota(jnp.int32, (qlp, block_size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (qlp, block_size), 1)
    causal = cols <= rows + (block_size - query_len)  # [QLp, BS] inside the newest block
    qs = [q_ref[g].astype(jnp.float32) for g in range(num_groups)]

    def logits(w):  # one [QLp, BS] per query head of the group
        k = k_ref[tables_ref[w]].astype(jnp.float32)  # [BS, D]
        visible = jnp.logical_or(causal, w != n - 1)
        out = []
        for q in qs:
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
            )
            out.append(jnp.where(visible, s * scale, -jnp.inf))
        return out

    def stats(w, carry):  # online row max and row sum of exp over all pages
        ms, ls = carry
        new_ms, new_ls = [], []
        for s, m, l in zip(logits(w), ms, ls):
            m_new = jnp.maximum(m, s.max(axis=1))
            new_ls.append(l * jnp.exp(m - m_new) + jnp.exp(s - m_new[:, None]).sum(axis=1))
            new_ms.append(m_new)
        return tuple(new_ms), tuple(new_ls)

    init_m = tuple(jnp.full((qlp,), jnp.finfo(jnp.float32).min, jnp.float32) for _ in qs)
    init_l = tuple(jnp.zeros((qlp,), jnp.float32) for _ in qs)
    ms, ls = lax.fori_loop(0, n, stats, (init_m, init_l))
    query_valid = rows < query_len

    def write_scores(w, carry):
        p = None
        for s, m, l in zip(logits(w), ms, ls):
            pg = jnp.exp(s - m[:, None]) / l[:, None]
            p = pg if p is None else jnp.maximum(p, pg)
        o_ref[w] = jnp.where(query_valid, p, 0.0).sum(axis=0) / query_len
        return carry

    def write_zeros(w, carry):
        o_ref[w] = jnp.zeros((block_size,), jnp.float32)
        return carry

    lax.fori_loop(0, n, write_scores, 0)
    lax.fori_loop(n, num_pages, write_zeros, 0)


def _attention_score_call(q, block_tables, num_blocks, k_pool, *, query_len: int, interpret: bool):
    batch, num_kv_heads, num_groups, qlp, head_dim = q.shape
    num_kv_blocks, block_size = k_pool.shape[:2]
    width = block_tables.shape[1]
    kernel = functools.partial(_attention_score_kernel, query_len=query_len)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, width, block_size), jnp.float32),
        grid=(batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, num_groups, qlp, head_dim), lambda b, h: (b, h, 0, 0, 0)),  # q
            pl.BlockSpec((None, width), lambda b, h: (b, 0)),  # block_tables
            pl.BlockSpec((None, 1), lambda b, h: (b, 0)),  # num_blocks
            pl.BlockSpec((num_kv_blocks, block_size, None, head_dim),
                         lambda b, h: (0, 0, h, 0)),  # k_pool: one kv head of the whole pool
        ],
        out_specs=pl.BlockSpec((None, None, width, block_size), lambda b, h: (b, h, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="zipage_attention_score",
    )(q, block_tables, num_blocks[:, None], k_pool)


def _check(k_pool, queries, block_tables, num_blocks) -> None:
    if k_pool.ndim != 4 or queries.ndim != 4:
        raise ValueError(f"expected k_pool [NB, BS, Hkv, D] and queries [B, QL, Hq, D], "
                         f"got {k_pool.shape} and {queries.shape}")
    _, block_size, num_kv_heads, head_dim = k_pool.shape
    batch, query_len, num_q_heads, q_dim = queries.shape
    if q_dim != head_dim:
        raise ValueError(f"queries head_dim {q_dim} != k_pool head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    if not 1 <= query_len <= block_size:
        raise ValueError(f"query_cache_len must be in [1, block_size={block_size}], got {query_len}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or num_blocks.shape != (batch,):
        raise ValueError(f"expected block_tables [B={batch}, W] and num_blocks [B], "
                         f"got {block_tables.shape} and {num_blocks.shape}")
    if block_tables.dtype != jnp.int32 or num_blocks.dtype != jnp.int32:
        raise ValueError(f"block_tables and num_blocks must be int32, "
                         f"got {block_tables.dtype} and {num_blocks.dtype}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def attention_score(
    k_pool: jax.Array,
    queries: jax.Array,
    block_tables: jax.Array,
    num_blocks: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Scores of every token of each sequence under its cached queries (Pallas, Triton).

    Args:
      k_pool: [NB, BS, Hkv, D] keys of one layer (any float dtype; computed in float32).
      queries: [B, QL, Hq, D] the cached queries of each sequence.
      block_tables: [B, W] int32 physical blocks, padded with a real (dummy) block id.
      num_blocks: [B] int32 valid entries of each table; 0 for a padding row.

    Returns:
      [B, Hkv, W, BS] float32; padding positions are 0.
    """
    _check(k_pool, queries, block_tables, num_blocks)
    block_size, num_kv_heads, head_dim = k_pool.shape[1:]
    batch, query_len, num_q_heads, _ = queries.shape
    for name, size in (("block_size", block_size), ("head_dim", head_dim)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"the Pallas attention score needs a power-of-two {name} >= 16, got {size}")
    qlp = max(_MIN_DOT_ROWS, pl.next_power_of_2(query_len))
    q = queries.reshape(batch, query_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    q = q.transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, QL, D]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, qlp - query_len), (0, 0)))
    return _attention_score_call(q, block_tables, num_blocks, k_pool, query_len=query_len,
                                 interpret=interpret)


@jax.jit
def attention_score_reference(
    k_pool: jax.Array, queries: jax.Array, block_tables: jax.Array, num_blocks: jax.Array
) -> jax.Array:
    """The same scores in plain jnp (the XLA backend); arguments as `attention_score`."""
    _check(k_pool, queries, block_tables, num_blocks)
    block_size, num_kv_heads, head_dim = k_pool.shape[1:]
    batch, query_len, num_q_heads, _ = queries.shape
    width = block_tables.shape[1]
    k = k_pool[block_tables].astype(jnp.float32)  # [B, W, BS, Hkv, D]
    q = queries.astype(jnp.float32).reshape(batch, query_len, num_kv_heads, -1, head_dim)
    logits = jnp.einsum("bqhgd,bwshd->bhgqws", q, k, precision=lax.Precision.HIGHEST)
    logits = logits * head_dim**-0.5  # [B, Hkv, G, QL, W, BS]
    w = jnp.arange(width)[:, None]
    s = jnp.arange(block_size)[None, :]
    i = jnp.arange(query_len)[:, None, None]
    last = (num_blocks - 1)[:, None, None, None]
    visible = (w < num_blocks[:, None, None, None]) & ((w != last) | (s <= block_size - query_len + i))
    visible = visible[:, None, None]  # [B, 1, 1, QL, W, BS]
    m = jnp.where(visible, logits, -jnp.inf).max(axis=(-2, -1), keepdims=True)
    e = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(axis=(-2, -1), keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    return p.max(axis=2).mean(axis=2)
