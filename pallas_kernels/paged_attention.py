"""Paged decode attention: one new query token per sequence over its KV pages (Pallas/Triton).

Layouts (one layer):
  q:              [B, Hq, D]                one token per sequence, Hq = G * Hkv
  k_pool, v_pool: [num_blocks, BS, Hkv, D]  keys stored after RoPE; block 0 is the dummy block
  block_tables:   [B, W] int32              physical block ids, padded with the dummy block 0
  context_lens:   [B] int32                 valid slots of each row; 0 for padding rows
  out:            [B, Hq, D] in q.dtype     (zeros for rows with context_lens == 0)
Quantized pools (pallas_kernels/kv_quant.py) are int8 or float8_e4m3fn and come with
  k_scales, v_scales: [num_blocks, BS, Hkv] float32, one per token per kv head;
or int4, packed two values a byte:
  k_pool, v_pool:     [num_blocks, BS, Hkv, D / 2] uint8
  k_scales, v_scales: [num_blocks, BS, Hkv, D / 32] float16, one per group of 32 elements.

Attention sinks (`sinks` [Hq], gpt-oss): per query head a logit in the softmax's denominator
with no value; they join in the combine of the splits, outside the kernel, so None runs
exactly the program without them.

Slots at or past context_lens may hold anything (NaN included, scales too): they are masked
out of the logits and zeroed in V. A sliding window (static `window` > 0) hides the slots below
context_lens - window too, and each program starts its loop at the first step holding a visible slot.

The kernel runs on a grid (B, Hkv, k_splits). Each program owns one kv head of one row and
one contiguous share of the row's pages, loops over them block_k tokens at a time with a
float32 online softmax (base 2), and writes unnormalised float32 partials (o, l, m) that XLA
combines. The G query heads that share a kv head form the rows of one [block_h, D] tile,
padded to block_h >= 16 rows for the Triton dot. Blocks larger than block_k are split into
block_k-token pages by a free reshape of the pool, so every gathered tile is
[block_k, D] and every tile size is a power of two.
A quantized tile is converted to q's dtype for the dots and never scaled itself: the K scales
multiply the logit columns and the V scales the probabilities before the P.V dot, so no
dequantized pool is built in HBM.

int4 (`paged_decode_int4_kernel`) does the same per scale group. Every group of 32 elements is
an operand of its own, a strided view picked by its BlockSpec, so the kernel never slices a
tile: q as NG = D / 32 tiles [block_h, 32]; each pool as NG / 2 tiles [block_k, 32] of packed
bytes, whose low nibbles are group j and high nibbles group j + NG / 2 (unpacked as
(x & 15) - 8 and (x >> 4) - 8 in q's dtype); the scales as NG columns [block_k] (float16, used in
float32). The logits are sum_g (q_g . k_g) s_g, and the output keeps one float32 accumulator per
group, (p s_g) . v_g, written as NG outputs [block_h, 32] and concatenated outside the kernel.
The int4 pool holds its values in a Hadamard-rotated basis (kv_quant): the wrapper rotates q
before the kernel and the output after it, so the kernel never un-rotates a tile.

Its plain-XLA reference, `paged_decode_attention_reference`, lives beside the engine's XLA
attention in zipage_jax/layers/xla_paged_attention.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_pool import check_paged_inputs
from pallas_kernels.kv_quant import INT4_GROUP, check_kv_scales, is_int4, rotate_int4
from pallas_kernels.sinks import add_sinks, check_sinks
from pallas_kernels.tiling import next_power_of_two

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_DEFAULT_PROGRAMS = 128  # grid size to fill when the device does not report its core count
_LOG2E = math.log2(math.e)


def _dot(a, b, contract):  # float32 accumulation; contract: (a's axis, b's axis)
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _split_loop(block_tables_ref, lengths_ref, page_size: int, pages_per_step: int, window: int, body, carry):
    """Runs carry = body(pages [pages_per_step], valid [block_k], carry) over this program's share
    of the row's pages, block_k = pages_per_step * page_size tokens a step; window > 0: only the
    steps holding slots length - window .. length - 1."""
    pages_per_split = block_tables_ref.shape[0]
    block_k = pages_per_step * page_size
    split_start = pl.program_id(2) * pages_per_split * page_size
    length = lengths_ref[0]

    def step_fn(step, carry):
        pages = block_tables_ref[pl.ds(step * pages_per_step, pages_per_step)]
        slot = split_start + step * block_k + jnp.arange(block_k)
        valid = slot < length  # [block_k]
        if window:
            valid &= slot >= length - window
        return body(pages, valid, carry)

    split_len = jnp.clip(length - split_start, 0, pages_per_split * page_size)
    first_step = 0
    if window:
        first_step = jnp.maximum(length - window - split_start, 0) // block_k
    return lax.fori_loop(first_step, pl.cdiv(split_len, block_k), step_fn, carry)


def _online_softmax(logits, valid, m_prev, l_prev):
    """One base-2 online softmax step: logits [block_h, block_k] float32 (scaled), valid [block_k];
    returns p [block_h, block_k], alpha (the rescale of the old partials), m and l [block_h]."""
    logits = jnp.where(valid[None, :], logits, DEFAULT_MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(logits - m_next[:, None])
    return p, alpha, m_next, alpha * l_prev + p.sum(axis=1)


def _stats_init(block_h: int):  # m, l: [block_h] float32
    return jnp.full((block_h,), jnp.finfo(jnp.float32).min, jnp.float32), jnp.zeros((block_h,), jnp.float32)


def paged_decode_kernel(
    # inputs
    q_ref,  # [block_h, D]
    k_pages_ref,  # [num_pages, page_size, D]  (one kv head, strided view; q.dtype or quantized)
    v_pages_ref,  # [num_pages, page_size, D]
    block_tables_ref,  # [pages_per_split]
    lengths_ref,  # [1]
    *refs,  # quantized: k_scales_ref, v_scales_ref, then the outputs; else the outputs
    pages_per_step: int,
    scale_log2: float,
    window: int,
    quantized: bool,
):
    # k_scales_ref, v_scales_ref: [num_pages, page_size] float32 (one kv head)
    # outputs: o_ref [block_h, D] float32, unnormalised; l_ref [block_h] float32, softmax
    # denominator; m_ref [block_h] float32, running max of the base-2 logits
    if quantized:
        k_scales_ref, v_scales_ref, o_ref, l_ref, m_ref = refs
    else:
        o_ref, l_ref, m_ref = refs
    block_h, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    block_k = pages_per_step * page_size
    q = q_ref[...]

    def body(pages, valid, carry):
        o_prev, m_prev, l_prev = carry
        k = k_pages_ref[pages].reshape(block_k, head_dim).astype(q.dtype)
        v = v_pages_ref[pages].reshape(block_k, head_dim).astype(q.dtype)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # slots past length may be NaN
        logits = _dot(q, k, (1, 1))  # [block_h, block_k]
        if quantized:  # q.k = (q.k_q) s_k
            logits = logits * (k_scales_ref[pages].reshape(block_k) * scale_log2)[None, :]
        else:
            logits = logits * scale_log2
        p, alpha, m_next, l_next = _online_softmax(logits, valid, m_prev, l_prev)
        if quantized:  # p (s_v V_q) = (p s_v) V_q; masked: scales past length may be NaN
            p = p * jnp.where(valid, v_scales_ref[pages].reshape(block_k), 0.0)[None, :]
        o_next = alpha[:, None] * o_prev + _dot(p.astype(q.dtype), v, (1, 0))
        return o_next, m_next, l_next

    m, l = _stats_init(block_h)
    o, m, l = _split_loop(block_tables_ref, lengths_ref, page_size, pages_per_step, window, body,
                          (jnp.zeros((block_h, head_dim), jnp.float32), m, l))
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def paged_decode_int4_kernel(
    # inputs, per scale group g of 32 elements (NG = D / 32; the low nibbles hold groups [0, NG/2))
    q_refs,  # NG x [block_h, 32]: group g of the query
    k_refs,  # NG/2 x [num_pages, page_size, 32] uint8: packed bytes [32j, 32j + 32), groups j and j + NG/2
    v_refs,  # NG/2 x [num_pages, page_size, 32] uint8
    block_tables_ref,  # [pages_per_split]
    lengths_ref,  # [1]
    k_scale_refs,  # NG x [num_pages, page_size] float16: group g's scale of each token (one kv head)
    v_scale_refs,  # NG x [num_pages, page_size] float16
    # outputs
    o_refs,  # NG x [block_h, 32] float32: group g of the unnormalised output
    l_ref,  # [block_h] float32, softmax denominator
    m_ref,  # [block_h] float32, running max of the base-2 logits
    *,
    pages_per_step: int,
    scale_log2: float,
    window: int,
):
    block_h, group_size = q_refs[0].shape
    page_size = k_refs[0].shape[1]
    block_k = pages_per_step * page_size
    qs = [ref[...] for ref in q_refs]
    dtype = qs[0].dtype

    def unpack(refs, pages):  # NG x [block_k, 32] in q's dtype: the low nibbles' groups, then the high
        packed = [ref[pages].reshape(block_k, group_size) for ref in refs]
        return [(x & 15).astype(dtype) - 8 for x in packed] + [(x >> 4).astype(dtype) - 8 for x in packed]

    def scales(refs, pages):  # NG x [block_k] float32
        return [ref[pages].reshape(block_k).astype(jnp.float32) for ref in refs]

    def body(pages, valid, carry):
        o_prev, m_prev, l_prev = carry
        # q.k = sum_g (q_g.k_g) s_g: one dot and one column scaling per group
        logits = sum(_dot(q, k, (1, 1)) * s[None, :]
                     for q, k, s in zip(qs, unpack(k_refs, pages), scales(k_scale_refs, pages)))
        p, alpha, m_next, l_next = _online_softmax(logits * scale_log2, valid, m_prev, l_prev)
        # o_g = p (s_g V_g) = (p s_g) V_g; masked: scales past length may be NaN (unpacked values never are)
        o_next = tuple(alpha[:, None] * o + _dot((p * jnp.where(valid, s, 0.0)[None, :]).astype(dtype), v,
                                                 (1, 0))
                       for o, v, s in zip(o_prev, unpack(v_refs, pages), scales(v_scale_refs, pages)))
        return o_next, m_next, l_next

    m, l = _stats_init(block_h)
    o = tuple(jnp.zeros((block_h, group_size), jnp.float32) for _ in q_refs)
    o, m, l = _split_loop(block_tables_ref, lengths_ref, page_size, pages_per_step, window, body, (o, m, l))
    for o_ref, o_group in zip(o_refs, o):
        o_ref[...] = o_group
    l_ref[...] = l
    m_ref[...] = m


def _num_programs_target() -> int:
    """Programs that fill the GPU once: its streaming multiprocessors (JAX's `core_count`);
    _DEFAULT_PROGRAMS where the device does not say (CPU lowering under an abstract GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or _DEFAULT_PROGRAMS


def _paged_decode(q, k_pool, v_pool, block_tables, context_lens, scales, sinks, *, scale, window, block_h,
                  block_k, k_splits, num_warps, num_stages, interpret):
    # scales: () or (k_scales, v_scales), each [num_blocks, BS, Hkv] float32 (int4: [.., Hkv, D / 32] float16)
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, pool_dim = k_pool.shape
    group = q_heads // num_kv_heads

    # Kernel pages of page_size <= block_k tokens: a bitcast reshape of the pool.
    page_size = min(block_size, block_k)
    splits_per_block = block_size // page_size
    k_pages = k_pool.reshape(num_blocks * splits_per_block, page_size, num_kv_heads, pool_dim)
    v_pages = v_pool.reshape(k_pages.shape)
    scale_pages = [s.reshape(k_pages.shape[:3] + s.shape[3:]) for s in scales]  # the same page split
    page_tables = (block_tables[:, :, None] * splits_per_block
                   + jnp.arange(splits_per_block, dtype=jnp.int32)).reshape(batch, -1)
    pages_per_step = min(block_k // page_size, next_power_of_two(page_tables.shape[1]))
    num_steps = -(-page_tables.shape[1] // pages_per_step)
    if k_splits is None:
        k_splits = next_power_of_two(-(-_num_programs_target() // (batch * num_kv_heads)))
    k_splits = min(k_splits, next_power_of_two(num_steps))
    pages_per_split = next_power_of_two(-(-num_steps // k_splits)) * pages_per_step
    # Padding with dummy pages: they lie past every context length, so they are masked.
    page_tables = jnp.pad(page_tables,
                          ((0, 0), (0, k_splits * pages_per_split - page_tables.shape[1])))
    page_tables = page_tables.reshape(batch, k_splits, pages_per_split)

    rotated = is_int4(k_pool.dtype)  # the pool's basis: rotate q now and the output at the end
    q_tile = (rotate_int4(q).astype(q.dtype) if rotated else q).reshape(batch, num_kv_heads, group, head_dim)
    q_tile = jnp.pad(q_tile, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))  # [B, Hkv, block_h, D]

    tables_spec = pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0))
    lens_spec = pl.BlockSpec((1,), lambda b, h, s: (b,))
    stats_spec = pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, s, h, 0))
    stats_shape = (batch, k_splits, num_kv_heads, block_h)
    stats = jax.ShapeDtypeStruct(stats_shape, jnp.float32)
    options = {"pages_per_step": pages_per_step, "scale_log2": scale * _LOG2E, "window": window}
    if is_int4(k_pool.dtype):
        kernel = functools.partial(paged_decode_int4_kernel, **options)
        (q_in, k_in, v_in, *scales_in), (o_spec, o_shape) = _int4_operands(q_tile, k_pages, v_pages, scale_pages,
                                                                         stats_shape)
    else:
        kernel = functools.partial(paged_decode_kernel, quantized=bool(scales), **options)
        pool_spec = pl.BlockSpec((k_pages.shape[0], page_size, None, head_dim), lambda b, h, s: (0, 0, h, 0))
        scales_spec = pl.BlockSpec((k_pages.shape[0], page_size, None), lambda b, h, s: (0, 0, h))
        q_in = (q_tile, pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)))
        k_in, v_in = (k_pages, pool_spec), (v_pages, pool_spec)
        scales_in = [(x, scales_spec) for x in scale_pages]  # k_scales, v_scales (quantized pools)
        o_spec = pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, s, h, 0, 0))
        o_shape = jax.ShapeDtypeStruct((*stats_shape, head_dim), jnp.float32)
    inputs = [q_in, k_in, v_in, (page_tables, tables_spec), (context_lens, lens_spec), *scales_in]
    o, l, m = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, k_splits),
        in_specs=[spec for _, spec in inputs],
        out_specs=[o_spec, stats_spec, stats_spec],  # o, l, m
        out_shape=[o_shape, stats, stats],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_decode_{block_h=}_{block_k=}_{k_splits=}",
    )(*[x for x, _ in inputs])
    if is_int4(k_pool.dtype):
        o = jnp.concatenate(o, axis=-1)  # NG x [B, S, Hkv, block_h, 32] -> [B, S, Hkv, block_h, D]

    # Combine the splits; an empty split has l = 0, m = f32 min and drops out.
    m_all = m.max(axis=1, keepdims=True)
    weight = jnp.exp2(m - m_all)  # [B, S, Hkv, block_h]
    l_all = (weight * l).sum(axis=1)
    o_all = (weight[..., None] * o).sum(axis=1)
    if sinks is not None:  # base-2 logits like m; the padding rows of the tile get none
        sink = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group) * _LOG2E,
                       ((0, 0), (0, block_h - group)), constant_values=-jnp.inf)
        l_all, o_all = add_sinks(m_all[:, 0], l_all, o_all, sink, exp=jnp.exp2)
    out = o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # [B, Hkv, block_h, D]
    if rotated:
        out = rotate_int4(out)
    return out[:, :, :group].reshape(q.shape).astype(q.dtype)


def _int4_operands(q_tile, k_pages, v_pages, scale_pages, stats_shape):
    """The int4 kernel's (array, BlockSpec) inputs and its o (BlockSpecs, shapes), one per 32-element
    group of the head vector (the pools: one per packed pair of groups), each a strided view.

    q_tile: [B, Hkv, block_h, D]; k_pages, v_pages: [num_pages, page_size, Hkv, D / 2] uint8;
    scale_pages: k and v [num_pages, page_size, Hkv, D / 32] float16; stats_shape: (B, S, Hkv, block_h).
    Returns ((q, k, v, k_scales, v_scales) as (tuple of views, tuple of specs)), (o specs, o shapes)).
    """
    num_pages, page_size = k_pages.shape[:2]
    block_h, head_dim = q_tile.shape[2:]
    groups = head_dim // INT4_GROUP

    def per_group(view, block, index, count):  # count BlockSpecs of `view`, the g-th at index(b, h, s, g)
        return (view,) * count, tuple(pl.BlockSpec(block, functools.partial(index, g=g)) for g in range(count))

    q_in = per_group(q_tile.reshape(*q_tile.shape[:3], groups, INT4_GROUP),  # [B, Hkv, block_h, NG, 32]
                     (None, None, block_h, None, INT4_GROUP), lambda b, h, s, g: (b, h, 0, g, 0), groups)
    byte_block = (num_pages, page_size, None, None, INT4_GROUP)
    k_in, v_in = (per_group(x.reshape(*x.shape[:3], groups // 2, INT4_GROUP),  # [pages, page_size, Hkv, NG/2, 32]
                            byte_block, lambda b, h, s, g: (0, 0, h, g, 0), groups // 2) for x in (k_pages, v_pages))
    k_scales_in, v_scales_in = (per_group(x, (num_pages, page_size, None, None),  # [pages, page_size, Hkv, NG]
                                          lambda b, h, s, g: (0, 0, h, g), groups) for x in scale_pages)
    o_spec = pl.BlockSpec((None, None, None, block_h, INT4_GROUP), lambda b, h, s: (b, s, h, 0, 0))
    o_shape = jax.ShapeDtypeStruct((*stats_shape, INT4_GROUP), jnp.float32)
    return (q_in, k_in, v_in, k_scales_in, v_scales_in), ((o_spec,) * groups, (o_shape,) * groups)


@functools.partial(jax.jit, static_argnames=["scale", "window", "block_h", "block_k", "k_splits",
                                             "num_warps", "num_stages", "interpret"])
def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array, *,
                           k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                           scale: float | None = None, window: int = 0, sinks: jax.Array | None = None,
                           interpret: bool = False,
                           block_h: int = 16, block_k: int = 128, k_splits: int | None = None,
                           num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Decode attention of one query token per sequence over its pages.

    Args:
      q: [B, Hq, D] queries (rotated).
      k_pool, v_pool: [num_blocks, BS, Hkv, D] one layer's pool, BS a power of two >= 16;
        q's dtype, or int8 / float8_e4m3fn with scales, or [num_blocks, BS, Hkv, D / 2] uint8,
        packed int4 with scales (pallas_kernels/kv_quant.py).
      block_tables: [B, W] int32, padded with the dummy block 0.
      context_lens: [B] int32, valid slots per row (0: padding row, zero output).
      k_scales, v_scales: [num_blocks, BS, Hkv] float32, the quantized pool's per-token,
        per-kv-head scales (value = pool * scale); int4: [num_blocks, BS, Hkv, D / 32] float16,
        one per group of 32 elements; both or neither.
      scale: softmax scale, default 1/sqrt(D).
      window: sliding window in slots (0: none): a row of length n sees slots n - window .. n - 1.
      sinks: [Hq] per query head a logit in the softmax's denominator only (None: none).
      interpret: run the kernel in the Pallas interpreter (needed on CPU).
      block_h: query rows per tile (power of two >= 16; raised to cover the group G).
      block_k: tokens per inner step (power of two >= 16).
      k_splits: page splits per row, combined in float32; None sizes the grid to the GPU.
      num_warps, num_stages: Triton launch parameters.

    Returns:
      [B, Hq, D] in q.dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got {q.shape}")
    batch, q_heads, head_dim = q.shape
    check_paged_inputs(q_heads, head_dim, k_pool, v_pool, block_tables, batch)
    quantized = check_kv_scales(k_pool, k_scales, v_scales)
    if quantized and q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if not quantized and q.dtype != k_pool.dtype:
        raise ValueError(f"q dtype {q.dtype} != pool dtype {k_pool.dtype} (Triton dot)")
    if context_lens.shape != (batch,) or context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens must be int32 [B={batch}], "
                         f"got {context_lens.dtype}{list(context_lens.shape)}")
    for name, value in [("block size", k_pool.shape[1]), ("head_dim", head_dim),
                        ("block_h", block_h), ("block_k", block_k)]:
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if k_splits is not None and k_splits < 1:
        raise ValueError(f"k_splits must be >= 1, got {k_splits}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")
    check_sinks(sinks, q_heads)
    scale = head_dim**-0.5 if scale is None else scale
    block_h = max(block_h, next_power_of_two(q_heads // k_pool.shape[2]))
    scales = (k_scales, v_scales) if quantized else ()
    return _paged_decode(q, k_pool, v_pool, block_tables, context_lens, scales, sinks, scale=scale, window=window,
                         block_h=block_h, block_k=block_k, k_splits=k_splits,
                         num_warps=num_warps, num_stages=num_stages, interpret=interpret)
