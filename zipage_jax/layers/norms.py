"""RMSNorm as in Llama / Qwen (normalise in float32, cast back, then scale) and as in Gemma
(scale by 1 + weight in float32, then cast back; the weight is stored zero-centred)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """x: [..., N]; weight: [N] -> [..., N] in x's dtype; unit_offset: Gemma's (1 + weight)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype, unit_offset: bool = False):
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((size,), dtype))
        self.eps, self.unit_offset = eps, unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.unit_offset)
