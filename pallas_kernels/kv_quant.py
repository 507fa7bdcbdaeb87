"""Quantized KV cache storage: int8 or float8_e4m3fn values with one float32 scale per vector,
or int4 packed two to a byte with one float16 scale per group of 32 elements.

Format (one layer), int8 / fp8:
  k_pool, v_pool:     [num_blocks, BS, Hkv, D]      int8 or float8_e4m3fn
  k_scales, v_scales: [num_blocks, BS, Hkv]         float32, one per token per kv head
  value = pool * scale, computed in float32.
int4 (storage dtype uint8):
  k_pool, v_pool:     [num_blocks, BS, Hkv, D / 2]  uint8; byte j holds element j of the head
                      vector in its low nibble and element j + D/2 in its high nibble, each as
                      q + 8 with q an integer in [-7, 7] (offset binary: 8 is zero), so
                      unpacking is concat([byte & 15, byte >> 4], -1) - 8
  k_scales, v_scales: [num_blocks, BS, Hkv, D / 32] float16, one per token per kv head per group
                      of 32 consecutive elements of the unpacked vector (group g: [32g, 32g + 32))
  value = q * scale, computed in float32, in a ROTATED basis: int4 stores x @ H, H the
  orthonormal [D, D] Hadamard matrix (`int4_rotation`: symmetric, its own inverse), and
  `dequantize` returns (q * scale) @ H. The rotation spreads a key's outlier channels over all
  of them (QuaRot-style), so one scale per 32 values wastes less of its range; on the dev texts
  it cuts the attention error of an int4 cache by a third (docs/RESULTS.md). Attention never
  un-rotates the pool: it rotates the query (q . k = (q @ H) . (k @ H)) and the output
  (softmax(...) V = (softmax(...) (V @ H)) @ H). D must be a power of two and a multiple of 64,
  so a group never straddles the two nibble halves.

The scale is symmetric abs-max over the D channels (int4: over the group): scale = max|x| / qmax
(qmax 127 for int8, 448 for e4m3, 7 for int4), floored at the scale dtype's smallest normal
number, so an all-zero vector (group) gets a positive scale and dequantizes to exact zeros, and a
scale is never subnormal (GPUs may flush those to zero). int4 rounds the scale to float16 first
and quantizes with the stored scale. Keys are quantized after RoPE. Inputs must be finite;
float32 subnormal inputs may be flushed to zero (XLA on CPU does).

Round-trip error per element: int8 <= scale / 2 (max|x| / 254); e4m3 <= 2**-4 * |x| for
normals (half an ulp, 3 mantissa bits) and <= 2**-10 * scale in e4m3's subnormal range;
int4 (in the rotated basis, so per rotated element; in the original basis the L2 norm of a
vector's error is the same) <= s / 2 with s the stored float16 scale, and s <= max|x| / 7 * (1 + 2**-11) (float16
rounding) unless floored at 2**-14; groups with max|x| > 7 * 65504 (float16's largest scale)
saturate instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "int4")
INT4_GROUP = 32  # unpacked elements per int4 scale
_INT4 = jnp.dtype(jnp.uint8)  # int4's storage: two values a byte
_STORAGE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn), "int4": _INT4}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0, _INT4: 7.0}
_MIN_SCALE = float(np.finfo(np.float32).tiny)
_F16 = np.finfo(np.float16)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The pool's dtype for a `kv_cache_dtype` name: the model dtype for "auto", uint8 for "int4"."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in _STORAGE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _STORAGE_DTYPES[kv_cache_dtype]


def is_quantized(dtype: jnp.dtype) -> bool:
    """Whether a pool of this dtype carries scales."""
    return jnp.dtype(dtype) in _QMAX


def is_int4(dtype: jnp.dtype) -> bool:
    """Whether a pool of this dtype holds packed int4 values (uint8, two a byte)."""
    return jnp.dtype(dtype) == _INT4


def pool_dim(head_dim: int, dtype: jnp.dtype) -> int:
    """The pool's last-axis size for head vectors of `head_dim`: D / 2 bytes for int4, else D."""
    if not is_int4(dtype):
        return head_dim
    if head_dim % (2 * INT4_GROUP) or head_dim & (head_dim - 1):
        raise ValueError(f"kv_cache_dtype 'int4' needs a power-of-two head_dim of at least {2 * INT4_GROUP} "
                         f"(a Hadamard rotation; scale groups of {INT4_GROUP} in each nibble half), got {head_dim}")
    return head_dim // 2


def int4_rotation(head_dim: int) -> np.ndarray:
    """H: [D, D] float32, the orthonormal Hadamard matrix (Sylvester's construction) int4 stores
    its values in: symmetric and its own inverse (H @ H = I)."""
    pool_dim(head_dim, _INT4)
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(math.sqrt(head_dim))


def rotate_int4(x: jax.Array) -> jax.Array:
    """x @ H over the last axis [..., D] in float32: into int4's basis, and back (H is its own inverse)."""
    h = jnp.asarray(int4_rotation(x.shape[-1]))
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)


def scales_shape(pool_shape: tuple[int, ...], dtype: jnp.dtype) -> tuple[int, ...]:
    """The scales' shape of a quantized pool [..., Dp]: [..., D / 32] for int4 (Dp = D / 2), else [...]."""
    if is_int4(dtype):
        return (*pool_shape[:-1], 2 * pool_shape[-1] // INT4_GROUP)
    return tuple(pool_shape[:-1])


def scales_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The scales' dtype of a quantized pool: float16 for int4, float32 for int8 / fp8."""
    return jnp.dtype(jnp.float16 if is_int4(dtype) else jnp.float32)


def token_bytes(head_dim: int, dtype: jnp.dtype) -> int:
    """Bytes of one token of one kv head in a K (or V) pool of `dtype`, its scales included."""
    dim = pool_dim(head_dim, dtype)
    scales = math.prod(scales_shape((dim,), dtype)) * scales_dtype(dtype).itemsize if is_quantized(dtype) else 0
    return dim * jnp.dtype(dtype).itemsize + scales


def _qmax(dtype: jnp.dtype) -> float:
    dtype = jnp.dtype(dtype)
    if dtype not in _QMAX:
        raise ValueError(f"quantized KV dtype must be int8, float8_e4m3fn or uint8 (packed int4), got {dtype}")
    return _QMAX[dtype]


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Symmetric abs-max quantization of each vector along the last axis (int4: of each group).

    Args:
      x: [..., D] floating point, finite (e.g. [T, Hkv, D] new keys after RoPE).
      dtype: storage dtype, int8, float8_e4m3fn or uint8 (packed int4, D a power of two >= 64).

    Returns:
      q: [..., D] in dtype (int8: rounded to nearest, in [-127, 127]; e4m3: rounded to
         nearest even, in [-448, 448], never NaN); int4: [..., D / 2] uint8, packed (module
         docstring), each value rounded to nearest even in [-7, 7].
      scale: [...] float32, >= float32's smallest normal; int4: [..., D / 32] float16 in
         [2**-14, 65504].
    """
    qmax = _qmax(dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize expects a floating-point array, got {x.dtype}")
    x = x.astype(jnp.float32)
    if is_int4(dtype):
        return _quantize_int4(x)
    scale = jnp.maximum(jnp.abs(x).max(axis=-1) / qmax, _MIN_SCALE)  # [...]
    y = jnp.clip(x / scale[..., None], -qmax, qmax)  # clip: e4m3fn has no inf, overflow is NaN
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def _quantize_int4(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    # x: [..., D] float32 -> (packed [..., D/2] uint8, scales [..., D/32] float16)
    head_dim = x.shape[-1]
    x = rotate_int4(x)  # ValueError unless D is a power of two >= 64
    groups = x.reshape(*x.shape[:-1], head_dim // INT4_GROUP, INT4_GROUP)  # [..., D/32, 32]
    scale = jnp.clip(jnp.abs(groups).max(axis=-1) / _QMAX[_INT4], float(_F16.smallest_normal), float(_F16.max))
    scale = scale.astype(jnp.float16)  # [..., D/32]; quantize with the stored scale
    q = jnp.clip(jnp.round(groups / scale.astype(jnp.float32)[..., None]), -7, 7).astype(jnp.int32) + 8
    q = q.reshape(x.shape).astype(jnp.uint8)  # [..., D] in [1, 15]
    lo, hi = q[..., : head_dim // 2], q[..., head_dim // 2 :]
    return lo | (hi << 4), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype, *, rotated: bool = False) -> jax.Array:
    """q * scale in float32, returned in dtype.

    Args:
      q: [..., D] int8 or float8_e4m3fn, or [..., D / 2] uint8 (packed int4).
      scale: [...] float32, or [..., D / 32] float16 for int4.
      dtype: output dtype.
      rotated: int4 only: leave the values in the rotated basis (for attention that rotates its
        queries and outputs instead, `rotate_int4`).

    Returns:
      [..., D] in dtype.
    """
    _qmax(q.dtype)
    if is_int4(q.dtype) and q.shape[-1] % INT4_GROUP:
        raise ValueError(f"a packed int4 array's last axis (D / 2) must be a multiple of {INT4_GROUP}, "
                         f"got {q.shape}")
    expected = scales_shape(q.shape, q.dtype)
    if scale.shape != expected:
        raise ValueError(f"scale shape {scale.shape} must be {expected} for a {q.dtype}{list(q.shape)} array")
    if scale.dtype != scales_dtype(q.dtype):
        raise ValueError(f"scale must be {scales_dtype(q.dtype)}, got {scale.dtype}")
    if not is_int4(q.dtype):
        return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
    values = jnp.concatenate([q & 15, q >> 4], axis=-1).astype(jnp.float32) - 8  # [..., D]
    groups = values.reshape(*scale.shape, INT4_GROUP) * scale.astype(jnp.float32)[..., None]
    values = groups.reshape(values.shape)
    return (values if rotated else rotate_int4(values)).astype(dtype)


def check_kv_scales(k_pool: jax.Array, k_scales: jax.Array | None,
                    v_scales: jax.Array | None) -> bool:
    """ValueError unless the scales fit the pool; returns whether the pool is quantized.

    A quantized pool needs both k_scales and v_scales: [num_blocks, BS, Hkv] float32 for an
    int8 / fp8 pool [num_blocks, BS, Hkv, D], [num_blocks, BS, Hkv, D / 32] float16 for an int4
    pool [num_blocks, BS, Hkv, D / 2] uint8; any other pool takes neither.
    """
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (or neither)")
    if k_scales is None:
        if is_quantized(k_pool.dtype):
            raise ValueError(f"a {k_pool.dtype} pool needs k_scales and v_scales")
        return False
    if not is_quantized(k_pool.dtype):
        raise ValueError(f"k_scales/v_scales need an int8, float8_e4m3fn or uint8 (packed int4) pool, "
                         f"got {k_pool.dtype}")
    if is_int4(k_pool.dtype) and k_pool.shape[-1] % INT4_GROUP:
        raise ValueError(f"an int4 pool's last axis (D / 2) must be a multiple of {INT4_GROUP}, got {k_pool.shape}")
    shape, dtype = scales_shape(k_pool.shape, k_pool.dtype), scales_dtype(k_pool.dtype)
    layout = "[num_blocks, BS, Hkv, D / 32]" if is_int4(k_pool.dtype) else "[num_blocks, BS, Hkv]"
    for name, scales in [("k_scales", k_scales), ("v_scales", v_scales)]:
        if scales.shape != shape or scales.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} {list(shape)} ({layout}), "
                             f"got {scales.dtype}{list(scales.shape)}")
    return True
