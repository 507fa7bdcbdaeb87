"""The engine's attention: write new K/V (and cached queries) into the pool, then attend
over each sequence's pages. Decode uses the paged decode kernel (Pallas on GPU, XLA on CPU);
prefill chunks attend over cached prefix blocks plus the chunk itself.

The XLA path reads the pool in pages of `xla_page_size(block_size)` tokens (a free reshape of
[num_blocks, BS, ...]): its tables list only the pages the longest row needs, so a short
sequence in a 256-token block gathers 16 tokens, not 256. The Pallas kernel reads whole blocks.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_xla
from pallas_kernels.prefill_attention import paged_prefill_attention
from zipage_jax.engine.kv_state import KVState

if TYPE_CHECKING:
    from zipage_jax.engine.sharding import TensorParallel


class StepInputs(NamedTuple):
    tokens: jax.Array  # [B, C] int32
    positions: jax.Array  # [B, C] int32, logical positions (RoPE)
    slots: jax.Array  # [B, C] int32, flat pool slot block * BS + offset (padding: dummy block 0)
    query_index: jax.Array | None  # [B, C] int32, flat query-cache row slot * QL + i (else the
    #                                padding row); None when no row caches queries
    block_tables: jax.Array  # [B, W] int32 blocks (pallas) or pages (xla), padded with page 0
    kv_lens: jax.Array  # [B, C] int32, pool slots visible to each token (0 for padding)
    last_index: jax.Array  # [B] int32, index in C of the token whose logits are sampled


def paged_attention_fn(inputs: StepInputs, backend: str, tp: TensorParallel | None = None):
    """An `attn_fn(layer, q, k, v, kv_state)` for the decoder; backend: xla | pallas | pallas-interpret.

    With `tp`, the Pallas decode kernel runs per shard on its heads (shard_map)."""

    def attn(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, state: KVState):
        # q: [B, C, Hq, D]; k, v: [B, C, Hkv, D]
        k_pool = _scatter_rows(state.k[layer], inputs.slots, k)
        v_pool = _scatter_rows(state.v[layer], inputs.slots, v)
        state = state.replace_layer(layer, k=k_pool, v=v_pool)
        if inputs.query_index is not None:
            state = state.replace_layer(layer, queries=_scatter_rows(state.queries[layer], inputs.query_index, q))
        if backend == "xla":
            k_pool, v_pool = _as_pages(k_pool), _as_pages(v_pool)
        if q.shape[1] == 1:
            args = (q[:, 0], k_pool, v_pool, inputs.block_tables, inputs.kv_lens[:, 0])
            if backend == "xla":
                out = paged_decode_attention_xla(*args)
            else:
                kernel = functools.partial(paged_decode_attention, interpret=backend == "pallas-interpret")
                out = (kernel if tp is None else tp.per_shard_decode(kernel))(*args)
            out = out[:, None]
        else:
            out = paged_prefill_attention(q, k_pool, v_pool, inputs.block_tables, inputs.kv_lens)
        return out, state

    return attn


def xla_page_size(block_size: int) -> int:
    """Tokens per page the XLA path gathers (a divisor of the block size)."""
    return min(block_size, 16)


def _as_pages(pool: jax.Array) -> jax.Array:
    # [num_blocks, BS, Hkv, D] -> [num_blocks * BS / P, P, Hkv, D]; flat slot ids are unchanged
    page = xla_page_size(pool.shape[1])
    return pool.reshape((-1, page) + pool.shape[2:])


def _scatter_rows(cache: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    """cache: [N0, N1, ...rest]; index: [B, C] flat into N0*N1; rows: [B, C, ...rest].

    Indexes the two leading axes (not a reshaped view), so XLA updates the donated buffer in
    place instead of copying it."""
    index = index.reshape(-1)
    rows = rows.reshape((-1,) + cache.shape[2:]).astype(cache.dtype)
    return cache.at[index // cache.shape[1], index % cache.shape[1]].set(rows)
