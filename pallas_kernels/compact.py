"""In-place compaction of each sequence's kept tokens into its target blocks (Zipage).

For every (sequence, kv head) the kept tokens, in their original order, are packed into
the target blocks: the d-th kept token goes to slot `d % BS` of block `targets[d // BS]`.
Keys, values and (optionally) the score cache move together; every other slot of the pool
is left as it was.

In-place safety: the d-th kept token sits at logical position p >= d, so destination block
j only reads logical blocks >= j. Writing destination blocks in increasing order is safe as
long as `targets[j]` is either the sequence's own block j or a block it does not read at
all (a fresh block replacing a shared prefix block): never one of its blocks after j.
Different kv heads live in disjoint slices, different sequences in disjoint blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _compact_kernel(
    # inputs
    src_ref,  # [M, BS] flat pool slot feeding each destination slot, -1: none
    count_ref,  # [1] destination slots to fill
    targets_ref,  # [M] destination blocks
    *refs,  # pools in (aliased with the outputs, unused), then pools out:
    # keys [NB*BS, D], values [NB*BS, D], scores [NB*BS] (optional)
):
    pools = refs[len(refs) // 2 :]
    block_size = src_ref.shape[1]

    def move(j, carry):
        slots = src_ref[j]  # [BS]
        valid = slots >= 0
        safe = jnp.where(valid, slots, 0)
        dst = pl.ds(targets_ref[j] * block_size, block_size)
        for ref in pools:
            rows = ref[safe]  # [BS, D] or [BS]
            mask = valid if rows.ndim == 1 else valid[:, None]
            ref[dst] = jnp.where(mask, rows, ref[dst])
        return carry

    lax.fori_loop(0, pl.cdiv(count_ref[0], block_size), move, 0)


def _pool_spec(x):  # one kv head's slice of a flattened pool
    trailing = (0,) * (x.ndim - 2)
    return pl.BlockSpec((x.shape[0], None, *x.shape[2:]), lambda b, h: (0, h, *trailing))


def _compact_call(src, count, targets, pools, *, interpret: bool):
    batch, num_kv_heads, num_targets, block_size = src.shape
    flat = [p.reshape((-1,) + p.shape[2:]) for p in pools]  # [NB*BS, Hkv(, D)]
    specs = [_pool_spec(x) for x in flat]
    out = pl.pallas_call(
        _compact_kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        grid=(batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, num_targets, block_size), lambda b, h: (b, h, 0, 0)),  # src
            pl.BlockSpec((None, None, 1), lambda b, h: (b, h, 0)),  # count
            pl.BlockSpec((None, num_targets), lambda b, h: (b, 0)),  # targets
            *specs,
        ],
        out_specs=specs,
        input_output_aliases={3 + i: i for i in range(len(flat))},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="zipage_compact",
    )(src, count[..., None], targets, *flat)
    return [o.reshape(p.shape) for o, p in zip(out, pools)]


def _moves(keep, block_tables, target_tables):
    """Source slot of every destination slot, how many are filled, destination slots."""
    batch, num_kv_heads, width, block_size = keep.shape
    capacity = target_tables.shape[1] * block_size
    flat_keep = keep.reshape(batch, num_kv_heads, width * block_size)
    rank = jnp.cumsum(flat_keep, axis=-1, dtype=jnp.int32) - 1  # destination of each kept token
    dest = jnp.where(flat_keep & (rank < capacity), rank, capacity)  # capacity: dropped
    pos = jnp.arange(width * block_size)
    src_slot = block_tables[:, pos // block_size] * block_size + pos % block_size  # [B, T]
    b = jnp.arange(batch)[:, None, None]
    h = jnp.arange(num_kv_heads)[None, :, None]
    src = jnp.full((batch, num_kv_heads, capacity), -1, jnp.int32)
    src = src.at[b, h, dest].set(jnp.broadcast_to(src_slot[:, None], dest.shape), mode="drop")
    count = jnp.minimum(flat_keep.sum(axis=-1, dtype=jnp.int32), capacity)
    d = jnp.arange(capacity)
    dst = target_tables[:, d // block_size] * block_size + d % block_size  # [B, C]
    return src, count, dst


def _check(pools, keep, block_tables, target_tables) -> None:
    if not pools or pools[0].ndim < 3:
        raise ValueError("expected at least one pool [NB, BS, Hkv, ...]")
    expected = pools[0].shape[:3]
    for p in pools:
        if p.shape[:3] != expected:
            raise ValueError(f"every pool must be [NB, BS, Hkv, ...] = {expected}, got {p.shape}")
    num_kv_blocks, block_size, num_kv_heads = expected
    batch = block_tables.shape[0]
    expected = (batch, num_kv_heads, block_tables.shape[1], block_size)
    if keep.shape != expected or keep.dtype != jnp.bool_:
        raise ValueError(f"expected keep bool [B, Hkv, W, BS] = {expected}, got {keep.dtype} {keep.shape}")
    if target_tables.ndim != 2 or target_tables.shape[0] != batch:
        raise ValueError(f"expected target_tables [B={batch}, M], got {target_tables.shape}")
    if block_tables.dtype != jnp.int32 or target_tables.dtype != jnp.int32:
        raise ValueError("block_tables and target_tables must be int32")


@functools.partial(jax.jit, static_argnames=("interpret",))
def compact(pools, keep, block_tables, target_tables, *, interpret: bool = False):
    """Packs the kept tokens into the target blocks, in place (Pallas, Triton); pools: per-token
    arrays [NB, BS, Hkv, ...] moved together."""
    _check(pools, keep, block_tables, target_tables)
    src, count, _ = _moves(keep, block_tables, target_tables)
    batch, num_kv_heads = count.shape
    src = src.reshape(batch, num_kv_heads, target_tables.shape[1], pools[0].shape[1])
    return _compact_call(src, count, target_tables, list(pools), interpret=interpret)


@jax.jit
def compact_reference(pools, keep, block_tables, target_tables):
    """The same compaction as one gather and one scatter per pool (the XLA backend)."""
    _check(pools, keep, block_tables, target_tables)
    src, _, dst = _moves(keep, block_tables, target_tables)
    num_slots = pools[0].shape[0] * pools[0].shape[1]
    dst = jnp.where(src >= 0, dst[:, None], num_slots)  # out of range: dropped
    src = jnp.maximum(src, 0)
    heads = jnp.arange(keep.shape[1])[None, :, None]

    def move(pool):
        flat = pool.reshape((num_slots,) + pool.shape[2:])
        return flat.at[dst, heads].set(flat[src, heads], mode="drop").reshape(pool.shape)

    return [move(p) for p in pools]
