"""The engine's attention: write new K/V (and cached queries) into the pool, then attend over
each row's pages. Decode rows use the paged decode kernel (Pallas) on GPU; everything else, and
everything on CPU, uses the XLA loop of `pallas_kernels.xla_attention`, which writes the new
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

from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.xla_attention import NewKV, Pools, paged_attention, scatter_rows, write_kv
from zipage_jax.layers.kv_cache import KVState

Backend = str  # "xla" | "pallas" | "pallas-interpret"


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
    return backend != "xla" and chunk == 1


def paged_attention_fn(inputs: StepInputs, backend: Backend,
                       per_shard_decode: Callable[[Callable], Callable] | None = None):
    """An `attn_fn(layer, q, k, v, kv_state)` for the decoder.

    per_shard_decode: wraps the Pallas decode kernel to run per tensor-parallel shard (shard_map);
    None on one device."""

    def attn(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, state: KVState):
        # q: [R, C, Hq, D]; k, v: [R, C, Hkv, D]
        queries = scatter_rows(state.queries[layer], inputs.query_index, q)
        pools = Pools(state.k[layer], state.v[layer], _layer(state.k_scales, layer), _layer(state.v_scales, layer))
        new = NewKV(inputs.slots, k, v)
        if uses_block_tables(backend, q.shape[1]):
            pools = write_kv(pools, new)
            kernel = functools.partial(paged_decode_attention, interpret=backend == "pallas-interpret")
            kernel = kernel if per_shard_decode is None else per_shard_decode(kernel)
            out = kernel(q[:, 0], pools.k, pools.v, inputs.block_tables, inputs.kv_lens[:, 0],
                         **_scales_kwargs(pools))[:, None]
        else:
            page = xla_page_size(pools.k.shape[1])
            out, paged = paged_attention(q, _as_pages(pools, page), inputs.block_tables, inputs.kv_lens, new)
            pools = _as_blocks(paged, pools)
        return out, state.replace_layer(layer, queries=queries, k=pools.k, v=pools.v, k_scales=pools.k_scales,
                                        v_scales=pools.v_scales)

    return attn


def _layer(items, layer):
    return None if items is None else items[layer]


def _scales_kwargs(pools: Pools) -> dict:
    return {} if pools.k_scales is None else {"k_scales": pools.k_scales, "v_scales": pools.v_scales}


def _as_pages(pools: Pools, page: int) -> Pools:
    """[num_blocks, BS, ...] -> [num_blocks * BS / page, page, ...]: flat slot ids are unchanged."""
    return Pools(*(None if a is None else a.reshape((-1, page) + a.shape[2:]) for a in pools))


def _as_blocks(paged: Pools, like: Pools) -> Pools:
    return Pools(*(None if a is None else a.reshape(b.shape) for a, b in zip(paged, like)))
