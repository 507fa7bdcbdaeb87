"""Paged attention in plain XLA for C query tokens per row (prefill rows, decode C=1).

Layouts (one layer):
  q:            [B, C, Hq, D]            C tokens per row, Hq = G * Hkv
  k_pool/v_pool [num_pages, P, Hkv, D]   keys stored after RoPE; page 0 is the dummy page
                                         (int4: [num_pages, P, Hkv, D / 2] packed, see below)
  block_tables: [B, W] int32             pages of each row, padded with the dummy page 0
  kv_lens:      [B, C] int32             pool slots token c may see (its own slot index + 1:
                                         causal); 0 for padding -> zeros
  window:       static int               sliding window: token c sees only slots
                                         kv_len - window <= s < kv_len (0: all of them)
  sinks:        [Hq] float or None       per query head a logit joining the softmax's
                                         denominator (no value), folded in after the loop
  out:          [B, C, Hq, D] in q.dtype

The keys are visited `tokens_per_step` at a time in a `fori_loop` whose trip count is the
longest row's length, so the table width W costs nothing but the table itself: one compiled
program serves every context length. Slots at or past a row's largest kv_len may hold anything
(NaN included): they are masked out of the logits and zeroed in V; with a window, so may the
slots below every token's window, and the loop starts at the first step that holds a slot some
token of the batch sees.

`new_kv` writes this step's K/V into the pools *inside* the loop body, before the read. The
writes are idempotent (the same rows to the same slots every iteration), and they keep the
donated pools loop-carried state: read by the loop and written after it, XLA would copy every
pool once per layer and per step to keep the loop's operands apart from the in-place write.
Rows of one sequence laid over several rows of the same step see each other through the pool.

Quantized pools (`kv_quant`): int8 / float8_e4m3fn with `k_scales`, `v_scales` [num_pages, P, Hkv]
float32, or int4 packed into [num_pages, P, Hkv, D / 2] uint8 with `k_scales`, `v_scales`
[num_pages, P, Hkv, D / 32] float16; new K/V are quantized when written and the gathered tiles
are dequantized (unpacked) before the dots.
GQA is a grouped einsum: KV heads are never repeated.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_quant
from pallas_kernels.kv_pool import KVPool, check_paged_inputs
from pallas_kernels.sinks import add_sinks, check_sinks

_LOGITS_PER_STEP = 1 << 22  # float32 logits per loop step (16 MiB)
_STEP_TOKENS_ONE_ROW, _STEP_TOKENS = 256, 128  # keys per loop step, powers of two


class NewKV(NamedTuple):
    slots: jax.Array  # [B, C] int32 flat pool slot (page * P + offset); padding: the dummy page
    k: jax.Array  # [B, C, Hkv, D]
    v: jax.Array  # [B, C, Hkv, D]


def tokens_per_step(batch: int, chunk: int, q_heads: int, page: int) -> int:
    """Keys per loop step, a power of two: 256 for one row, 128 for more, fewer when the logits of
    a step would pass _LOGITS_PER_STEP. A longer step gathers keys past a short row's end for
    every row; `zipage-jax bench xla-attention` measures the choice (docs/RESULTS.md)."""
    tokens = min(_STEP_TOKENS_ONE_ROW if batch == 1 else _STEP_TOKENS,
                 max(1, _LOGITS_PER_STEP // (batch * chunk * q_heads)))
    tokens = 1 << (tokens.bit_length() - 1)
    return max(page, tokens // page * page)


def _write(pools: KVPool, new: NewKV) -> KVPool:
    k, v = new.k, new.v
    if pools.k_scales is None:
        return pools._replace(k=scatter_rows(pools.k, new.slots, k), v=scatter_rows(pools.v, new.slots, v))
    (kq, ks), (vq, vs) = kv_quant.quantize(k, pools.k.dtype), kv_quant.quantize(v, pools.v.dtype)
    return pools._replace(k=scatter_rows(pools.k, new.slots, kq), v=scatter_rows(pools.v, new.slots, vq),
                          k_scales=scatter_rows(pools.k_scales, new.slots, ks),
                          v_scales=scatter_rows(pools.v_scales, new.slots, vs))


def scatter_rows(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """pool: [N0, N1, ...rest]; slots: [B, C] flat into N0*N1; rows: [B, C, ...rest].

    Indexes the two leading axes (not a reshaped view), so XLA updates the buffer in place."""
    slots = slots.reshape(-1)
    rows = rows.reshape((-1,) + pool.shape[2:]).astype(pool.dtype)
    return pool.at[slots // pool.shape[1], slots % pool.shape[1]].set(rows)


def _gather(pool: jax.Array, scales: jax.Array | None, pages: jax.Array, dtype) -> jax.Array:
    # int4 tiles stay in the pool's rotated basis: _attend rotates the queries and outputs
    # pages: [B, S] -> [B, S * P, Hkv, D] (unpacked for int4); a flat index list gathers faster on XLA's CPU
    # backend than a [B, S] index array (whole pages copied as rows)
    flat = pages.reshape(-1)
    x = pool[flat]
    if scales is not None:
        x = kv_quant.dequantize(x, scales[flat], dtype, rotated=True)
    return x.reshape(pages.shape[0], -1, *x.shape[2:])


def _attend(q, pools: KVPool, block_tables, kv_lens, scale, step_tokens, window: int, new_kv: NewKV | None,
            sinks: jax.Array | None):
    # q: [B, C, Hkv, G, D]; kv_lens: [B, C]
    batch, chunk, num_kv_heads, group, head_dim = q.shape
    page = pools.k.shape[1]
    pages_per_step = step_tokens // page
    # dummy-page padding to whole steps: those slots lie past every kv_len, so they are masked
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % pages_per_step)))
    row_lens = kv_lens.max(axis=1)  # [B]: V rows at or past this may be garbage
    num_steps = jnp.maximum(-(-row_lens.max() // step_tokens), 1)  # >= 1: the writes must happen
    first_step = 0
    if window:  # V rows below row_lows may be garbage too; steps wholly below every row's are skipped
        row_lows = jnp.where(kv_lens > 0, kv_lens - window, jnp.iinfo(jnp.int32).max).min(axis=1)  # [B]
        first_step = jnp.clip(row_lows.min() // step_tokens, 0, num_steps - 1)
    kv_dtype = q.dtype
    # head-major: every product is a matmul batched over (row, kv head), which XLA's CPU backend
    # runs several times faster than the same contraction with the heads inside
    qh = q.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, chunk * group, head_dim)  # [B, Hkv, C*G, D]
    rotated = kv_quant.is_int4(pools.k.dtype)  # q . k = (q @ H) . (k @ H); the output is rotated back below
    if rotated:
        qh = kv_quant.rotate_int4(qh).astype(q.dtype)
    lens = jnp.repeat(kv_lens, group, axis=1)[:, None, :, None]  # [B, 1, C*G, 1]

    def visible(pos):  # [T] -> [B, 1, C*G, T]
        seen = pos < lens
        return seen & (pos >= lens - window) if window else seen

    def step_fn(step, carry):
        pools, m, l, acc = carry  # m, l: [B, Hkv, C*G]; acc: [B, Hkv, C*G, D]
        if new_kv is not None:
            pools = _write(pools, new_kv)
        pages = lax.dynamic_slice_in_dim(block_tables, step * pages_per_step, pages_per_step, axis=1)
        k = _gather(pools.k, pools.k_scales, pages, kv_dtype).transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
        v = _gather(pools.v, pools.v_scales, pages, kv_dtype).transpose(0, 2, 1, 3)
        pos = step * step_tokens + jnp.arange(step_tokens)  # [T]
        v_rows = pos[None, :] < row_lens[:, None]  # [B, T]
        if window:
            v_rows &= pos[None, :] >= row_lows[:, None]
        v = jnp.where(v_rows[:, None, :, None], v, 0)
        s = jnp.einsum("bhqd,bhtd->bhqt", qh, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible(pos), s, -jnp.inf)  # [B, Hkv, C*G, T]
        m_next = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        pv = jnp.einsum("bhqt,bhtd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return pools, m_next, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

    stats_shape = (batch, num_kv_heads, chunk * group)
    carry = (pools, jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
             jnp.zeros((*stats_shape, head_dim), jnp.float32))
    pools, m, l, acc = lax.fori_loop(first_step, num_steps, step_fn, carry)
    if sinks is not None:  # per (kv head, c * G + g): query head kv * G + g's sink
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, chunk))
        l, acc = add_sinks(m, l, acc, sink)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, Hkv, C*G, D]
    if rotated:
        out = kv_quant.rotate_int4(out)
    return out.reshape(batch, num_kv_heads, chunk, group, head_dim).transpose(0, 2, 1, 3, 4), pools


@functools.partial(jax.jit, static_argnames=["scale", "step_tokens", "window"])
def paged_attention(q: jax.Array, pools: KVPool, block_tables: jax.Array, kv_lens: jax.Array,
                    new_kv: NewKV | None = None, *, scale: float | None = None,
                    step_tokens: int | None = None, window: int = 0,
                    sinks: jax.Array | None = None) -> tuple[jax.Array, KVPool]:
    """Attention of C tokens per row over their pages, writing `new_kv` first if given.

    Args:
      q: [B, C, Hq, D] queries (rotated).
      pools: the layer's pools, [num_pages, P, Hkv, D] each (int4: D / 2) plus scales when quantized.
      block_tables: [B, W] int32 pages, padded with the dummy page 0.
      kv_lens: [B, C] int32, slots each token sees (0: padding token, zero output).
      new_kv: this step's K/V and their slots, written into the pools before any read.
      scale: softmax scale, default 1/sqrt(D).
      step_tokens: keys per loop step (a multiple of P); default from `tokens_per_step`.
      window: sliding window in slots (0: none): a token of kv_len n sees slots n - window .. n - 1.
      sinks: [Hq] per query head a logit in the softmax's denominator only (None: none).

    Returns:
      (out [B, C, Hq, D] in q.dtype, the pools after the write).
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, C, Hq, D], got {q.shape}")
    batch, chunk, q_heads, head_dim = q.shape
    check_paged_inputs(q_heads, head_dim, pools.k, pools.v, block_tables, batch)
    kv_quant.check_kv_scales(pools.k, pools.k_scales, pools.v_scales)
    if kv_lens.shape != (batch, chunk) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be int32 [B, C]={batch, chunk}, "
                         f"got {kv_lens.dtype}{list(kv_lens.shape)}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")
    check_sinks(sinks, q_heads)
    page = pools.k.shape[1]
    step_tokens = step_tokens or tokens_per_step(batch, chunk, q_heads, page)
    if step_tokens % page:
        raise ValueError(f"step_tokens {step_tokens} must be a multiple of the page size {page}")
    num_kv_heads = pools.k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    q_grouped = q.reshape(batch, chunk, num_kv_heads, q_heads // num_kv_heads, head_dim)
    out, pools = _attend(q_grouped, pools, block_tables, kv_lens, scale, step_tokens, window, new_kv, sinks)
    return out.reshape(q.shape).astype(q.dtype), pools


def write_kv(pools: KVPool, new_kv: NewKV) -> KVPool:
    """This step's K/V into the pools (quantized when they are), for paths that read them later."""
    return _write(pools, new_kv)


@functools.partial(jax.jit, static_argnames=["scale", "window"])
def paged_decode_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                                     block_tables: jax.Array, context_lens: jax.Array, *,
                                     scale: float | None = None, window: int = 0,
                                     sinks: jax.Array | None = None) -> jax.Array:
    """Plain-XLA decode attention, same contract as the Pallas kernel
    `pallas_kernels.paged_attention.paged_decode_attention`."""
    if q.ndim != 3 or context_lens.ndim != 1:
        raise ValueError(f"q must be [B, Hq, D] and context_lens [B], "
                         f"got {q.shape} and {context_lens.shape}")
    out, _ = paged_attention(q[:, None], KVPool(k_pool, v_pool), block_tables, context_lens[:, None], scale=scale,
                             window=window, sinks=sinks)
    return out[:, 0]

