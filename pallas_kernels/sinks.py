"""Attention sinks (gpt-oss): per query head one logit that joins the softmax's denominator
and carries no value. Folded into online-softmax partials after the loop over the keys, so the
paged attention paths run their sink-free programs unchanged and add this at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sinks(sinks: jax.Array | None, q_heads: int) -> None:
    """ValueError unless sinks is None or one float per query head."""
    if sinks is not None and (sinks.shape != (q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be float [Hq={q_heads}], got {sinks.dtype}{list(sinks.shape)}")


def add_sinks(m: jax.Array, l: jax.Array, acc: jax.Array, sink: jax.Array, exp=jnp.exp
              ) -> tuple[jax.Array, jax.Array]:
    """Online-softmax partials (max m, denominator l [...], unnormalised output acc [..., D]) with
    one more logit `sink` (broadcast to m) in the denominator and none in the output: (l, acc)
    rescaled to the new max. exp: jnp.exp2 for base-2 logits."""
    m_next = jnp.maximum(m, sink)
    m_next = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # nothing visible and a sink of -inf
    alpha = exp(m - m_next)  # 0 where nothing was visible (m = -inf or the float32 minimum)
    return alpha * l + exp(sink - m_next), alpha[..., None] * acc
