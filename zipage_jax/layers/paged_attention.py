"""The engine's attention: write new K/V (and cached queries) into the pool, then attend over
each row's pages. Decode rows use the paged decode kernel (Pallas) on GPU; everything else, and
everything on CPU, uses the XLA loop of `layers.xla_paged_attention`, which writes the new
K/V inside its loop (see its docstring) and whose cost follows the longest row, not the table
width.

The XLA path reads the pool in pages of `xla_page_size(block_size)` tokens (a free reshape of
[num_blocks, BS, ...]), so a short sequence in a 256-token block gathers 16 tokens, not 256.
The Pallas kernel reads whole blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from pallas_kernels.kv_pool import KVPool
from pallas_kernels.paged_attention import paged_decode_attention
from zipage_jax.backend import Backend
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.xla_paged_attention import NewKV, paged_attention, scatter_rows, write_kv


class StepInputs(NamedTuple):
    tokens: jax.Array  # [R, C] int32; -1: the row's last sampled token, read on the device
    positions: jax.Array  # [R, C] int32, logical positions (RoPE)
    slots: jax.Array  # [R, C] int32, flat pool slot block * BS + offset (padding: dummy block 0)
    query_index: jax.Array  # [R, C] int32, flat query-cache row slot * QL + i (else the padding row)
    block_tables: jax.Array  # [R, W] int32 blocks (pallas decode) or pages (xla), padded with 0
    kv_lens: jax.Array  # [R, C] int32, pool slots visible to each token (0 for padding)
    last_index: jax.Array  # [R] int32, index in C of the token whose logits are sampled


def xla_page_size(block_size: int) -> int:
    """Tokens per page the XLA path gathers (a divisor of the block size)."""
    return min(block_size, 16)


def uses_block_tables(backend: Backend, chunk: int) -> bool:
    """Whether rows of `chunk` tokens attend through block tables (Pallas decode) or page tables."""
    return backend.uses_pallas and chunk == 1


def paged_attention_fn(inputs: StepInputs, backend: Backend,
                       per_shard_decode: Callable[[Callable], Callable] | None = None):
    """An `attn_fn(layer, q, k, v, kv_state, *, window=0, scale=None, sinks=None)` for the decoder (see
    layers/attention.py): a sliding window bounds each token's visible slots from below, in slot
    space (kv_lens - window <= slot < kv_lens).

    per_shard_decode: wraps the Pallas decode kernel to run per tensor-parallel shard (shard_map);
    None on one device."""

    def attn(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, state: KVState, *, window: int = 0,
             scale: float | None = None, sinks: jax.Array | None = None):
        # q: [R, C, Hq, D]; k, v: [R, C, Hkv, D]
        queries = scatter_rows(state.queries[layer], inputs.query_index, q)
        layer_pool = state.pools[layer]
        pool = layer_pool._replace(scores=None, positions=None)  # compression's bookkeeping, not attention's
        new = NewKV(inputs.slots, k, v)
        if uses_block_tables(backend, q.shape[1]):
            pool = write_kv(pool, new)
            kernel = functools.partial(paged_decode_attention, interpret=backend.interpret, window=window, scale=scale)
            kernel = kernel if per_shard_decode is None else per_shard_decode(kernel)
            out = kernel(q[:, 0], pool.k, pool.v, inputs.block_tables, inputs.kv_lens[:, 0],
                         **_scales_kwargs(pool), **({} if sinks is None else {"sinks": sinks}))[:, None]
        else:
            page = xla_page_size(pool.block_size)
            out, paged = paged_attention(q, pool.reshape_pages(page), inputs.block_tables, inputs.kv_lens, new,
                                         window=window, scale=scale, sinks=sinks)
            pool = paged.reshape_like(pool)
        pool = pool._replace(scores=layer_pool.scores, positions=layer_pool.positions)
        return out, state.replace_layer(layer, pool, queries)

    return attn


def _scales_kwargs(pool: KVPool) -> dict:
    return {} if pool.k_scales is None else {"k_scales": pool.k_scales, "v_scales": pool.v_scales}
