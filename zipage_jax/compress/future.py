"""Predicted attention of future queries, from the query centre and RoPE (TriAttention-style).

TriAttention (Mao et al., arXiv 2604.04921) observes that pre-RoPE queries of a head cluster
around a fixed centre, so the logit a future query at distance Δ gives a key is predicted by
rotating that centre by Δ: a trigonometric series in Δ over RoPE's frequencies, plus a norm
term for the part of the queries that does not sit on the centre. No future attention has to
be observed, so a key that matters again later (a fact stated early in a long reasoning) is
not judged only by what the last few queries looked at.

Here the centre is estimated online from each sequence's cached queries (the paper calibrates
it offline): query i of QL sits QL - 1 - i positions before the newest one, so rotating it
forward by that distance puts every cached query at the newest position, where they are
averaged. Keys are stored after RoPE at their own positions, so the rotated centre dotted with
a stored key is exactly the predicted logit, whatever compaction did to the key's slot.

For a frequency f (the pair of dimensions f, f + D/2 that RoPE rotates together) with centre
c_f, mean query norm n_f = mean_i |q_i,f| and key k:
  logit(k, Δ) = D**-0.5 * (R(Δ θ) c . k + sum_f (n_f - |c_f|) |k_f|)
The score of a key is the softmax of these logits over the sequence's tokens, the max over
the G query heads of its kv head, then the mean over the distances Δ = 1, 2, 4, ..., 2**12.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zipage_jax.layers.rotary import inv_frequencies

FUTURE_DISTANCES = tuple(2**i for i in range(13))  # 1 .. 4096 tokens ahead
DEFAULT_ROPE_THETA = 10000.0


def rope_inv_freq(head_dim: int, inv_freq: tuple[float, ...] = ()) -> np.ndarray:
    """[D/2] float32: the model's RoPE inverse frequencies, or RoPE with theta 10,000 when empty."""
    if not inv_freq:
        return inv_frequencies(head_dim, DEFAULT_ROPE_THETA)
    if len(inv_freq) != head_dim // 2:
        raise ValueError(f"rope inverse frequencies must have head_dim/2 = {head_dim // 2} entries, "
                         f"got {len(inv_freq)}")
    return np.asarray(inv_freq, np.float32)


def rotate(x: jax.Array, angles: jax.Array) -> jax.Array:
    """RoPE rotation (rotate_half convention) of x [..., D] by angles [..., D/2] (broadcast)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def pair_norms(x: jax.Array) -> jax.Array:
    """|x_f| of every RoPE pair: [..., D] -> [..., D/2]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.sqrt(x1 * x1 + x2 * x2)


def future_attention(keys: jax.Array, queries: jax.Array, valid: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Predicted attention of future queries over every token.

    Args:
      keys: [B, W, BS, Hkv, D] the sequences' keys (after RoPE), any float dtype.
      queries: [B, QL, Hq, D] the cached queries (after RoPE), the last one newest.
      valid: [B, 1, W, BS] bool, the tokens that exist.
      inv_freq: [D/2] RoPE inverse frequencies.

    Returns:
      [B, Hkv, W, BS] float32, 0 on invalid tokens.
    """
    batch, width, block_size, num_kv_heads, head_dim = keys.shape
    query_len, num_heads = queries.shape[1:3]
    freq = jnp.asarray(inv_freq, jnp.float32)
    q = queries.astype(jnp.float32).reshape(batch, query_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    ahead = jnp.arange(query_len - 1, -1, -1, dtype=jnp.float32)  # [QL] distance to the newest query
    centred = rotate(q, (ahead[:, None] * freq)[None, :, None, None, :])  # [B, QL, Hkv, G, D]
    centre = centred.mean(axis=1)  # [B, Hkv, G, D]
    spread = pair_norms(q).mean(axis=1) - pair_norms(centre)  # [B, Hkv, G, D/2]
    distances = jnp.asarray(FUTURE_DISTANCES, jnp.float32)
    future = rotate(centre[None], (distances[:, None] * freq)[:, None, None, None, :])  # [Δ, B, Hkv, G, D]
    k = keys.astype(jnp.float32).transpose(0, 3, 1, 2, 4)  # [B, Hkv, W, BS, D]
    norm_term = jnp.einsum("bhgf,bhwsf->bhgws", spread, pair_norms(k), precision=lax.Precision.HIGHEST)
    mask = valid[:, :, None]  # [B, 1, 1, W, BS]

    def add_distance(i, total):  # total: [B, Hkv, W, BS]
        logits = jnp.einsum("bhgd,bhwsd->bhgws", future[i], k, precision=lax.Precision.HIGHEST)
        logits = (logits + norm_term) * head_dim**-0.5  # [B, Hkv, G, W, BS]
        m = jnp.where(mask, logits, -jnp.inf).max(axis=(-2, -1), keepdims=True)
        e = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
        p = e / jnp.maximum(e.sum(axis=(-2, -1), keepdims=True), jnp.finfo(jnp.float32).tiny)
        return total + p.max(axis=2)

    total = lax.fori_loop(0, len(FUTURE_DISTANCES), add_distance, jnp.zeros((batch, num_kv_heads, width, block_size)))
    return total / len(FUTURE_DISTANCES)
