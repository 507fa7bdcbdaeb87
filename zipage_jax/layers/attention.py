"""Attention functions with the decoder's `attn_fn` signature.

attn_fn(layer, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D], cache, *, window, scale)
    -> (out [B, T, Hq, D], cache)
q and k arrive after q/k-norm and RoPE; the attn_fn applies the softmax scale (D**-0.5 unless
given) and, for a sliding-window layer (window > 0), lets a query at p see keys p - window < s <= p.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def causal_attention(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, *, window: int = 0,
                     scale: float | None = None) -> tuple[jax.Array, Any]:
    """Plain causal self-attention over the T tokens given (positions 0..T-1); cache passes through."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    q = q.reshape(B, T, Hkv, Hq // Hkv, D)  # q head h reads kv head h // (Hq // Hkv)
    scale = D**-0.5 if scale is None else scale
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.tril(jnp.ones((T, T), dtype=bool))
    if window:
        visible &= ~jnp.tril(visible, -window)  # key s hidden from query t once t - s >= window
    scores = jnp.where(visible, scores, -jnp.inf)  # scores: [B, Hkv, G, T, S]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, Hq, D), cache
