"""Paged attention in plain XLA for C query tokens per sequence (prefill chunks, decode C=1).

Layouts (one layer):
  q:            [B, C, Hq, D]            C new tokens per sequence, Hq = G * Hkv
  k_pool/v_pool [num_blocks, BS, Hkv, D] keys stored after RoPE; block 0 is the dummy block
  block_tables: [B, W] int32             physical block ids, padded with the dummy block 0
  kv_lens:      [B, C] int32             pool slots token c may see: its own slot index + 1
                                         (causal within the chunk); 0 for padding -> zeros
  out:          [B, C, Hq, D] in q.dtype

The new tokens' K/V must already be in the pool. Slots at or past a row's largest kv_len may
hold anything (NaN included): they are masked out of the logits and zeroed in V.
The keys are visited a few pages at a time with a float32 online softmax. A step's logits stay
under _LOGITS_BUDGET elements and its gathered K/V under _KV_STEP_BYTES (small temporaries are
what make this fast on CPU, where writing fresh memory costs more than the attention math),
unless that needs more than _MAX_STEPS steps. The steps are unrolled in Python, not a
`fori_loop`: a while loop that reads the pool makes XLA copy the whole donated pool, per layer
and per step, to keep the loop's operands apart from the in-place K/V writes.
GQA is a grouped einsum: KV heads are never repeated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_LOGITS_BUDGET = 1 << 24  # float32 logits per step (64 MiB)
_KV_STEP_BYTES = 1 << 24  # gathered K plus V per step (16 MiB)
_MAX_STEPS = 8  # unrolled steps per call (compile time)


def check_paged_inputs(q_heads: int, head_dim: int, k_pool: jax.Array, v_pool: jax.Array,
                       block_tables: jax.Array, batch: int) -> None:
    """ValueError unless the pool, the block tables and the query heads fit together."""
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [num_blocks, BS, Hkv, D], "
                         f"got {k_pool.shape} and {v_pool.shape}")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool dtypes differ: {k_pool.dtype} vs {v_pool.dtype}")
    _, _, num_kv_heads, pool_head_dim = k_pool.shape
    if pool_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pool head_dim {pool_head_dim}")
    if q_heads % num_kv_heads:
        raise ValueError(f"query heads {q_heads} are not a multiple of kv heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, W], got {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")


def _attend_pages(q, k_pool, v_pool, block_tables, kv_lens, scale):
    # q: [B, C, Hkv, G, D]; kv_lens: [B, C]
    batch, chunk, num_kv_heads, group, head_dim = q.shape
    _, block_size, _, _ = k_pool.shape
    width = block_tables.shape[1]
    kv_token_bytes = 2 * batch * num_kv_heads * head_dim * k_pool.dtype.itemsize
    max_tokens = min(_LOGITS_BUDGET // (batch * chunk * num_kv_heads * group),
                     _KV_STEP_BYTES // kv_token_bytes)
    pages_per_step = max(1, min(width, max_tokens // block_size), -(-width // _MAX_STEPS))
    num_steps = -(-width // pages_per_step)
    # Dummy-block padding: those slots are past every kv_len, so they are masked.
    block_tables = jnp.pad(block_tables, ((0, 0), (0, num_steps * pages_per_step - width)))
    step_tokens = pages_per_step * block_size
    row_lens = kv_lens.max(axis=1)  # [B]: V rows at or past this may be garbage

    def step_fn(step, carry):
        m, l, acc = carry  # m, l: [B, C, Hkv, G]; acc: [B, C, Hkv, G, D]
        pages = block_tables[:, step * pages_per_step:(step + 1) * pages_per_step]
        k = k_pool[pages].reshape(batch, step_tokens, num_kv_heads, head_dim)  # [B, T, Hkv, D]
        v = v_pool[pages].reshape(batch, step_tokens, num_kv_heads, head_dim)
        pos = step * step_tokens + jnp.arange(step_tokens)  # [T]
        v = jnp.where((pos[None, :] < row_lens[:, None])[:, :, None, None], v, 0)
        s = jnp.einsum("bchgd,bthd->bchgt", q, k, preferred_element_type=jnp.float32) * scale
        visible = (pos[None, None, :] < kv_lens[:, :, None])[:, :, None, None, :]  # [B,C,1,1,T]
        s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("bchgt,bthd->bchgd", p.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
        return m_next, l, alpha[..., None] * acc + pv

    stats_shape = (batch, chunk, num_kv_heads, group)
    carry = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
             jnp.zeros((*stats_shape, head_dim), jnp.float32))
    for step in range(num_steps):
        carry = step_fn(step, carry)
    _, l, acc = carry
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=["scale"])
def paged_prefill_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                            block_tables: jax.Array, kv_lens: jax.Array, *,
                            scale: float | None = None) -> jax.Array:
    """Attention of C new tokens per sequence over their pages (the new K/V already written).

    Args:
      q: [B, C, Hq, D] queries (rotated).
      k_pool, v_pool: [num_blocks, BS, Hkv, D] one layer's pool.
      block_tables: [B, W] int32, padded with the dummy block 0.
      kv_lens: [B, C] int32, number of slots each token sees (0: padding token, zero output).
      scale: softmax scale, default 1/sqrt(D).

    Returns:
      [B, C, Hq, D] in q.dtype.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, C, Hq, D], got {q.shape}")
    batch, chunk, q_heads, head_dim = q.shape
    check_paged_inputs(q_heads, head_dim, k_pool, v_pool, block_tables, batch)
    if kv_lens.shape != (batch, chunk) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be int32 [B, C]={batch, chunk}, "
                         f"got {kv_lens.dtype}{list(kv_lens.shape)}")
    num_kv_heads = k_pool.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    q_grouped = q.reshape(batch, chunk, num_kv_heads, q_heads // num_kv_heads, head_dim)
    out = _attend_pages(q_grouped, k_pool, v_pool, block_tables, kv_lens, scale)
    return out.reshape(q.shape).astype(q.dtype)
