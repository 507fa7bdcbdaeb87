"""In-place compaction of each sequence's kept tokens into its target blocks (Zipage).

For every (sequence, kv head) the kept tokens, in their original order, are packed into
the target blocks: the d-th kept token goes to slot `d % BS` of block `targets[d // BS]`.
Every pool given (keys, values, score cache, quantization scales, ...) moves with the
tokens; every other slot of every pool is left as it was.

Which targets are allowed: `targets[j]` is either the sequence's own block j (in place) or
a block nobody reads (a fresh block replacing a shared prefix block); never one of the
sequence's other blocks, never a block of another sequence.

Why the Pallas kernel is race-free. One program per (sequence, kv head); programs touch
disjoint memory (their own kv head's slice, their own targets; shared prefix blocks are only
read). Inside a program, the destinations d = 0, 1, ... are filled in chunks of S
consecutive slots (S divides BS), chunk c = destinations [cS, (c+1)S), in increasing c, and
each chunk of each pool is moved in three steps:
  1. every lane gathers its source row into registers (lane i: the token kept at logical
     position p_i >= cS + i);
  2. a barrier (`debug_barrier`, a CTA-wide bar.sync): no thread goes on until every thread
     of the program has finished all its loads so far;
  3. every lane with a token stores its row to the chunk's contiguous destination slots.
Within a chunk, all loads precede all stores, so a lane whose source is another lane's
destination (keep positions 1 and 2: 2 -> 1 while 1 -> 0) reads the old token. Across
chunks: chunk c writes the slots of logical positions [cS, (c+1)S) (in place) or of a block
nobody reads (fresh), and every later chunk reads only positions p >= d >= (c+1)S, so no
slot is read after it was written (no read-after-write); the loads of earlier chunks that
do overlap a later chunk's destinations (write-after-read) finished before that chunk's
barrier. The trip count is one scalar per program, so every thread meets every barrier, and
num_stages=1: no software pipelining moves a later chunk's loads above a barrier.
In interpret mode every load and store is one whole-array operation in program order, so
the barrier (which has no CPU lowering) is emitted only for the Triton kernel.

The kernel moves bits: every pool is seen as unsigned ints of its width, so any 1, 2 or
4-byte dtype (float8, int8, packed int4 bytes, float16 scales, bfloat16, float32, ...) comes out
bit for bit, with any trailing dims (a packed int4 pool [.., Hkv, D / 2] and its group scales
[.., Hkv, D / 32] move as whole rows).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_TILE_ELEMS = 8192  # elements of one pool's chunk held in registers (64 per thread at 4 warps)


def _compact_kernel(
    # inputs
    src_ref,  # [C/S, S] flat pool slot feeding each destination slot, -1: none
    count_ref,  # [1] destination slots to fill
    starts_ref,  # [C/S] first flat pool slot of each destination chunk
    *refs,  # pools in (aliased with the outputs, unused), then pools out, each [NB*BS, *trailing]
    barrier: bool,
):
    pools = refs[len(refs) // 2 :]
    chunk = src_ref.shape[1]

    def move(c, carry):
        slots = src_ref[c]  # [S]
        valid = slots >= 0
        safe = jnp.where(valid, slots, 0)  # slot 0: this head's row of the dummy block
        dst = pl.ds(pl.multiple_of(starts_ref[c], chunk), chunk)
        for ref in pools:
            rows = ref[safe]  # [S, *trailing]
            if barrier:
                pltriton.debug_barrier()
            mask = jnp.broadcast_to(valid.reshape((chunk,) + (1,) * (rows.ndim - 1)), rows.shape)
            pltriton.store(ref.at[dst], rows, mask=mask)
        return carry

    lax.fori_loop(0, pl.cdiv(count_ref[0], chunk), move, 0)


def _pool_spec(x):  # one kv head's slice of a flattened pool [NB*BS, Hkv, *trailing]
    trailing = (0,) * (x.ndim - 2)
    return pl.BlockSpec((x.shape[0], None, *x.shape[2:]), lambda b, h: (0, h, *trailing))


def _chunk_rows(pools, block_size: int) -> int:
    """S: the largest power of two <= BS whose chunk of the widest pool fits _TILE_ELEMS."""
    row = max(math.prod(p.shape[3:]) for p in pools)
    return min(block_size, 1 << max(0, (_TILE_ELEMS // row).bit_length() - 1))


def _compact_call(src, count, starts, pools, *, interpret: bool):
    batch, num_kv_heads, num_chunks, chunk = src.shape
    # [NB*BS, Hkv, *trailing] as unsigned ints of the same width: the kernel moves bits, so no
    # dtype is special to Triton and the interpreter cannot flush or canonicalise anything
    flat = [lax.bitcast_convert_type(p.reshape((-1,) + p.shape[2:]), _BITS[p.dtype.itemsize])
            for p in pools]
    specs = [_pool_spec(x) for x in flat]
    out = pl.pallas_call(
        functools.partial(_compact_kernel, barrier=not interpret),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        grid=(batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, num_chunks, chunk), lambda b, h: (b, h, 0, 0)),  # src
            pl.BlockSpec((None, None, 1), lambda b, h: (b, h, 0)),  # count
            pl.BlockSpec((None, num_chunks), lambda b, h: (b, 0)),  # starts
            *specs,
        ],
        out_specs=specs,
        input_output_aliases={3 + i: i for i in range(len(flat))},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="zipage_compact",
    )(src, count[..., None], starts, *flat)
    return [lax.bitcast_convert_type(o, p.dtype).reshape(p.shape) for o, p in zip(out, pools)]


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
    if not isinstance(pools, (list, tuple)) or not pools:
        raise ValueError(f"pools must be a non-empty list of arrays, got {type(pools).__name__}")
    if any(p.ndim < 3 for p in pools):
        raise ValueError(f"expected pools [NB, BS, Hkv, *trailing], got {[p.shape for p in pools]}")
    if len({p.shape[:3] for p in pools}) != 1:
        raise ValueError(f"pools must agree on [NB, BS, Hkv], got {[p.shape for p in pools]}")
    _, block_size, num_kv_heads = pools[0].shape[:3]
    batch = block_tables.shape[0]
    expected = (batch, num_kv_heads, block_tables.shape[1], block_size)
    if keep.shape != expected or keep.dtype != jnp.bool_:
        raise ValueError(f"expected keep bool [B, Hkv, W, BS] = {expected}, got {keep.dtype} {keep.shape}")
    if target_tables.ndim != 2 or target_tables.shape[0] != batch:
        raise ValueError(f"expected target_tables [B={batch}, M], got {target_tables.shape}")
    if block_tables.dtype != jnp.int32 or target_tables.dtype != jnp.int32:
        raise ValueError("block_tables and target_tables must be int32")


@functools.partial(jax.jit, static_argnames=("interpret",))
def compact(
    pools: Sequence[jax.Array],
    keep: jax.Array,
    block_tables: jax.Array,
    target_tables: jax.Array,
    *,
    interpret: bool = False,
) -> list[jax.Array]:
    """Packs the kept tokens of every pool into the target blocks, in place (Pallas, Triton).

    The pools are aliased to the outputs: donate them at the caller's jit boundary for a
    true in-place update (see the module docstring for the allowed targets and why the
    kernel is race-free).

    Args:
      pools: one layer's pools, each [NB, BS, Hkv, *trailing] of any dtype, all moved
        together: keys and values [NB, BS, Hkv, D] (int4: D / 2 bytes), score cache or
        per-token scales [NB, BS, Hkv] (int4: [NB, BS, Hkv, D / 32]). Trailing sizes must be
        powers of two (Triton tiles).
      keep: [B, Hkv, W, BS] bool, the tokens to keep; at most M*BS per (seq, head), more are
        dropped. A row keeping nothing (a padding row) writes nothing.
      block_tables: [B, W] int32 physical block of each logical block.
      target_tables: [B, M] int32 destination blocks, filled in order.

    Returns:
      the pools after compaction, in the order given.
    """
    _check(pools, keep, block_tables, target_tables)
    for p in pools:
        if p.dtype.itemsize not in _BITS:
            raise ValueError(f"the Pallas compaction moves 1, 2 or 4-byte elements, got {p.dtype}")
        if not interpret and any(n & (n - 1) for n in p.shape[3:]):
            raise ValueError(f"the Pallas compaction needs power-of-two trailing pool dims, got {p.shape}")
    block_size = pools[0].shape[1]
    src, count, dst = _moves(keep, block_tables, target_tables)
    chunk = _chunk_rows(pools, block_size)
    batch, num_kv_heads, capacity = src.shape
    src = src.reshape(batch, num_kv_heads, capacity // chunk, chunk)
    starts = dst[:, ::chunk]  # [B, C/S]; a chunk never crosses a block
    return _compact_call(src, count, starts, list(pools), interpret=interpret)


@jax.jit
def compact_reference(
    pools: Sequence[jax.Array],
    keep: jax.Array,
    block_tables: jax.Array,
    target_tables: jax.Array,
) -> list[jax.Array]:
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
