"""Attention functions with the decoder's `attn_fn` signature.

attn_fn(layer, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D], cache, *, window, scale, sinks)
    -> (out [B, T, Hq, D], cache)
q and k arrive after q/k-norm and RoPE; the attn_fn applies the softmax scale (D**-0.5 unless
given) and, for a sliding-window layer (window > 0), lets a query at p see keys p - window < s <= p.
sinks (gpt-oss): [Hq] float logits, one per query head, that join the softmax's denominator
(a key with no value); None: no sinks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def causal_attention(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, *, window: int = 0,
                     scale: float | None = None, sinks: jax.Array | None = None) -> tuple[jax.Array, Any]:
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
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # the sink is one more column of the softmax, dropped after it
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, Hkv, Hq // Hkv, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, Hq, D), cache
