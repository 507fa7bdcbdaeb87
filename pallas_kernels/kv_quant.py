"""Quantized KV cache storage: int8 or float8_e4m3fn values with one float32 scale per vector.

Format (one layer):
  k_pool, v_pool:     [num_blocks, BS, Hkv, D]  int8 or float8_e4m3fn
  k_scales, v_scales: [num_blocks, BS, Hkv]     float32, one per token per kv head
  value = pool * scale, computed in float32.

The scale is symmetric abs-max over the D channels: scale = max|x| / qmax (qmax 127 for int8,
448 for e4m3), floored at float32's smallest normal number, so an all-zero vector gets a
positive scale and dequantizes to exact zeros, and a scale is never subnormal (GPUs may flush
those to zero). Keys are quantized after RoPE. Inputs must be finite; float32 subnormal
inputs may be flushed to zero (XLA on CPU does).

Round-trip error per element: int8 <= scale / 2 (max|x| / 254); e4m3 <= 2**-4 * |x| for
normals (half an ulp, 3 mantissa bits) and <= 2**-10 * scale in e4m3's subnormal range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_STORAGE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
_MIN_SCALE = float(np.finfo(np.float32).tiny)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The pool's dtype for a `kv_cache_dtype` name: the model dtype for "auto"."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in _STORAGE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _STORAGE_DTYPES[kv_cache_dtype]


def is_quantized(dtype: jnp.dtype) -> bool:
    """Whether a pool of this dtype carries scales."""
    return jnp.dtype(dtype) in _QMAX


def _qmax(dtype: jnp.dtype) -> float:
    dtype = jnp.dtype(dtype)
    if dtype not in _QMAX:
        raise ValueError(f"quantized KV dtype must be int8 or float8_e4m3fn, got {dtype}")
    return _QMAX[dtype]


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Symmetric abs-max quantization of each vector along the last axis.

    Args:
      x: [..., D] floating point, finite (e.g. [T, Hkv, D] new keys after RoPE).
      dtype: storage dtype, int8 or float8_e4m3fn.

    Returns:
      q: [..., D] in dtype (int8: rounded to nearest, in [-127, 127]; e4m3: rounded to
         nearest even, in [-448, 448], never NaN).
      scale: [...] float32, >= float32's smallest normal.
    """
    qmax = _qmax(dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize expects a floating-point array, got {x.dtype}")
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.abs(x).max(axis=-1) / qmax, _MIN_SCALE)  # [...]
    y = jnp.clip(x / scale[..., None], -qmax, qmax)  # clip: e4m3fn has no inf, overflow is NaN
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """q * scale in float32, returned in dtype.

    Args:
      q: [..., D] int8 or float8_e4m3fn.
      scale: [...] float32.
      dtype: output dtype.

    Returns:
      [..., D] in dtype.
    """
    _qmax(q.dtype)
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale shape {scale.shape} must be q's shape without the last axis, "
                         f"{q.shape[:-1]}")
    if scale.dtype != jnp.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def check_kv_scales(k_pool: jax.Array, k_scales: jax.Array | None,
                    v_scales: jax.Array | None) -> bool:
    """ValueError unless the scales fit the pool; returns whether the pool is quantized.

    A quantized pool [num_blocks, BS, Hkv, D] needs both k_scales and v_scales, each
    [num_blocks, BS, Hkv] float32; any other pool takes neither.
    """
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (or neither)")
    if k_scales is None:
        if is_quantized(k_pool.dtype):
            raise ValueError(f"a {k_pool.dtype} pool needs k_scales and v_scales")
        return False
    if not is_quantized(k_pool.dtype):
        raise ValueError(f"k_scales/v_scales need an int8 or float8_e4m3fn pool, "
                         f"got {k_pool.dtype}")
    for name, scales in [("k_scales", k_scales), ("v_scales", v_scales)]:
        if scales.shape != k_pool.shape[:-1] or scales.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 {list(k_pool.shape[:-1])} "
                             f"([num_blocks, BS, Hkv]), got {scales.dtype}{list(scales.shape)}")
    return True
