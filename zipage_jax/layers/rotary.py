"""Rotary position embedding in transformers' convention (rotate_half, cos/sin over both halves)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "linear" (factor) or "llama3" (all fields)."""

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@functools.lru_cache(maxsize=None)
def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """inv_freq: [head_dim // 2] float32, computed in float32 like transformers."""
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / np.float32(scaling.factor)
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(scaling.factor), inv_freq)
    smooth = (np.float32(old_len) / wavelen - np.float32(scaling.low_freq_factor)) / np.float32(
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: [...] int -> (cos, sin): [..., D] float32 (each half repeats the frequencies)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [..., D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, H, D]; cos, sin: [B, T, D] float32 -> [B, T, H, D] in x's dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)
