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
    """RoPE frequency scaling: "linear" (factor), "llama3" (factor, low/high_freq_factor,
    original_max_position_embeddings) or "yarn" (factor, beta_fast/slow, truncate,
    original_max_position_embeddings, attention_factor: the multiplier of cos and sin)."""

    rope_type: Literal["linear", "llama3", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@functools.lru_cache(maxsize=None)
def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """inv_freq: [head_dim // 2] float32, computed in float32 like transformers."""
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    pos_freqs = np.power(np.float32(theta), exponents)
    inv_freq = np.float32(1.0) / pos_freqs
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / np.float32(scaling.factor)
    if scaling.rope_type == "yarn":
        return _yarn(pos_freqs, head_dim, theta, scaling)
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


def _yarn(pos_freqs: np.ndarray, head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN: the low frequencies (under beta_slow rotations in the original context) divided by
    `factor`, the high ones (over beta_fast) kept, a linear ramp between, as transformers computes it."""

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)  # 1: the frequency kept
    interpolated = np.float32(1) / (np.float32(scaling.factor) * pos_freqs)
    return (interpolated * (1 - extrapolation) + np.float32(1) / pos_freqs * extrapolation).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """positions: [...] int -> (cos, sin): [..., D] float32 (each half repeats the frequencies),
    both multiplied by `attention_factor` (YaRN's) where it is not 1."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [..., D]
    if attention_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, H, D]; cos, sin: [B, T, D] float32 -> [B, T, H, D] in x's dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)
