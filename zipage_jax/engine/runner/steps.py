"""The device state every compiled step donates, and the steps beside the forward one
(engine/runner/forward.py): one layer's compaction, and a state slot's token history."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zipage_jax.backend import Backend
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import CompressRows
from zipage_jax.compress.step import compress_measured
from zipage_jax.engine.sharding import TensorParallel
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.sampler import SamplerState, record_inputs


class DeviceState(NamedTuple):
    kv: KVState
    sampler: SamplerState


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "tp", "rope"), donate_argnames=("kv",))
def compaction_program(kv: KVState, blocks: jax.Array, per_row: jax.Array, window: jax.Array, *, cfg: CompressionConfig,
                   backend: Backend, tp: TensorParallel | None, rope: tuple[float, ...]) -> tuple[KVState, jax.Array]:
    """One compaction step of one layer (`kv` holds that layer only): the runner calls the same
    program for every layer, so its compile time does not grow with depth. The tables come
    in two arrays (runner/compaction.py CompactionTables); `window` is the layer's sliding window
    (int32 scalar, 0: full attention), data, not a compile-time option. Also returns [shards, b, w]
    the attention share each row would evict keeping j blocks, per shard of kv heads (an automatic
    budget's measurement, 0 for a sliding layer; no collective, so the compaction stays free of them)."""
    # blocks: [2, b, w] i32 (the blocks read, the blocks written); per_row: [3 + len(CompressRows), b] i32
    block_tables, target_tables = blocks[0], blocks[1]
    num_blocks, query_ids, compressed = per_row[0], per_row[1], per_row[2] != 0
    rows = CompressRows(*per_row[3:])

    def step(kv: KVState, block_tables, num_blocks, query_ids, compressed, target_tables, rows, window):
        queries = list(kv.queries)
        if tp is not None:
            queries, query_ids = tp.group_queries(queries, query_ids)
        pools, lost = compress_measured(list(kv.pools), queries, block_tables, num_blocks, query_ids, compressed,
                                        target_tables, rows, cfg, backend, rope, (window,))
        return kv._replace(pools=tuple(pools)), lost[None]  # a shard's own kv heads: averaged on the host

    if tp is not None:  # each shard compresses its own kv heads
        step = tp.per_shard_kv(step, kv, shard_out=True)
    return step(kv, block_tables, num_blocks, query_ids, compressed, target_tables, rows, window)


@functools.partial(jax.jit, donate_argnames=("state",))
def seed_history(state: DeviceState, slot, tokens, num_prompt) -> DeviceState:
    """A sequence admitted with cached prefix tokens: clear its slot and count those tokens."""
    # slot, num_prompt: [1]; tokens: [1, N] (-1 padding)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    sampler = record_inputs(state.sampler, tokens, positions, tokens >= 0, slot, num_prompt,
                            jnp.ones((1,), jnp.bool_))
    return state._replace(sampler=sampler)
