"""RMSNorm as in Llama / Qwen: normalise in float32, cast back, then scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., N]; weight: [N] -> [..., N] in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
