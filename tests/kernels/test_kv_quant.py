"""Quantized KV storage: dtype names, and quantize/dequantize round trips against numpy bounds
(int8, fp8 and packed int4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import (
    KV_CACHE_DTYPES,
    check_kv_scales,
    dequantize,
    is_int4,
    is_quantized,
    kv_storage_dtype,
    pool_dim,
    quantize,
    scales_dtype,
    scales_shape,
    token_bytes,
)

F32_TINY = float(np.finfo(np.float32).tiny)
F16_TINY = float(np.finfo(np.float16).smallest_normal)  # 2**-14


def test_storage_dtype_names():
    assert KV_CACHE_DTYPES == ("auto", "int8", "fp8", "int4")
    assert kv_storage_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_storage_dtype("auto", jnp.float32) == jnp.float32
    assert kv_storage_dtype("int8", jnp.bfloat16) == jnp.int8
    assert kv_storage_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn
    assert kv_storage_dtype("int4", jnp.bfloat16) == jnp.uint8
    assert is_quantized(jnp.int8) and is_quantized(jnp.float8_e4m3fn) and is_quantized(jnp.uint8)
    assert is_int4(jnp.uint8) and not is_int4(jnp.int8)
    assert not is_quantized(jnp.bfloat16) and not is_quantized(jnp.float32)
    for bad in ["fp8_e5m2", "INT8", "float16", "", "int2", "uint8"]:
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            kv_storage_dtype(bad, jnp.float32)


def vectors(rng, dtype):
    """[6, 5, 32] vectors: per vector a magnitude from 1e-30 to 1e30, some all zero, some
    with one outlier channel, one near float32's max, one subnormal."""
    x = rng.standard_normal((6, 5, 32)) * 10.0 ** rng.uniform(-30, 30, (6, 5, 1))
    x[0, :3] = 0.0
    x[1, :, 7] *= 1000.0  # outlier channel
    x[2, 0] = rng.uniform(-1, 1, 32) * 3e38
    x[2, 1] = rng.uniform(-1, 1, 32) * 1e-40  # float32 subnormals
    if dtype == jnp.bfloat16:
        x = np.clip(x, -3e38, 3e38)
    x = jnp.asarray(x, jnp.float32).astype(dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_int8_round_trip(x_dtype):
    x, x64 = vectors(np.random.default_rng(0), x_dtype)
    q, scale = jax.jit(quantize, static_argnums=1)(x, jnp.int8)
    assert q.dtype == jnp.int8 and q.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    amax = np.abs(x64).max(axis=-1)
    expected_scale = np.maximum(amax / 127, F32_TINY)
    np.testing.assert_allclose(np.asarray(scale), expected_scale, rtol=1e-6)
    q64 = np.asarray(q, np.float64)
    assert np.abs(q64).max() <= 127
    # the abs-max channel lands on +-127 (every nonzero vector uses the full range)
    nonzero = amax > 127 * F32_TINY
    assert (np.abs(q64).max(axis=-1)[nonzero] == 127).all()
    out = np.asarray(dequantize(q, scale, jnp.float32), np.float64)
    err = np.abs(out - x64)
    bound = expected_scale[..., None] / 2  # round to nearest: half a step
    assert (err <= bound * (1 + 1e-4)).all(), (err / bound).max()
    np.testing.assert_array_equal(out[0, :3], 0.0)  # zero vectors come back as exact zeros
    assert np.isfinite(out).all()


def e4m3_round_trip_bound(x64, scale):
    # e4m3: 3 mantissa bits, so half an ulp is 2**-4 of the value's power of two for normals
    # (|x/scale| >= 2**-6); below that, half the smallest subnormal 2**-9, in units of scale.
    return np.maximum(2.0**-4 * np.abs(x64), 2.0**-10 * scale[..., None])


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_round_trip(x_dtype):
    x, x64 = vectors(np.random.default_rng(1), x_dtype)
    q, scale = quantize(x, jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    amax = np.abs(x64).max(axis=-1)
    expected_scale = np.maximum(amax / 448, F32_TINY)
    np.testing.assert_allclose(np.asarray(scale), expected_scale, rtol=1e-6)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    assert np.isfinite(q64).all() and np.abs(q64).max() <= 448
    nonzero = amax > 448 * F32_TINY
    assert (np.abs(q64).max(axis=-1)[nonzero] == 448).all()
    out = np.asarray(dequantize(q, scale, jnp.float32), np.float64)
    err = np.abs(out - x64)
    # plus float32's smallest normal: XLA may flush float32 subnormal inputs to zero
    bound = e4m3_round_trip_bound(x64, expected_scale) + F32_TINY
    assert (err <= bound * (1 + 1e-4)).all(), (err / bound).max()
    np.testing.assert_array_equal(out[0, :3], 0.0)
    # the relative bound is tight: some channel of a normal-range vector comes close to it
    rel = err[3:] / np.maximum(np.abs(x64[3:]), 1e-300)
    assert 2.0**-5 < rel.max() <= 2.0**-4 * (1 + 1e-4)


def test_dequantize_dtype_and_shape():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4, 2, 16)), jnp.float32)
    for dtype in [jnp.int8, jnp.float8_e4m3fn]:
        q, scale = quantize(x, dtype)
        assert scale.shape == (3, 4, 2)
        out32 = dequantize(q, scale, jnp.float32)
        out16 = dequantize(q, scale, jnp.bfloat16)
        assert out32.dtype == jnp.float32 and out16.dtype == jnp.bfloat16
        assert out16.shape == x.shape
        np.testing.assert_array_equal(np.asarray(out16, np.float32),
                                      np.asarray(out32.astype(jnp.bfloat16), np.float32))


def test_bad_arguments_raise():
    x = jnp.ones((2, 16), jnp.float32)
    for dtype in [jnp.int16, jnp.float16, jnp.float8_e5m2]:
        with pytest.raises(ValueError, match="int8, float8_e4m3fn or uint8"):
            quantize(x, dtype)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(jnp.ones((2, 16), jnp.int32), jnp.int8)
    q, scale = quantize(x, jnp.int8)
    with pytest.raises(ValueError, match="int8, float8_e4m3fn or uint8"):
        dequantize(x, scale, jnp.float32)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(q, scale[:1], jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        dequantize(q, scale.astype(jnp.bfloat16), jnp.float32)


def test_check_kv_scales():
    pool = jnp.zeros((3, 16, 2, 8), jnp.int8)
    scales = jnp.ones((3, 16, 2), jnp.float32)
    assert check_kv_scales(pool, scales, scales)
    assert not check_kv_scales(pool.astype(jnp.bfloat16), None, None)
    with pytest.raises(ValueError, match="together"):
        check_kv_scales(pool, scales, None)
    with pytest.raises(ValueError, match="needs k_scales"):
        check_kv_scales(pool.astype(jnp.float8_e4m3fn), None, None)
    with pytest.raises(ValueError, match="need an int8, float8_e4m3fn or uint8"):
        check_kv_scales(pool.astype(jnp.float32), scales, scales)
    with pytest.raises(ValueError, match="v_scales must be float32"):
        check_kv_scales(pool, scales, scales[:, :8])
    with pytest.raises(ValueError, match="k_scales must be float32"):
        check_kv_scales(pool, scales.astype(jnp.bfloat16), scales)


# -- int4: packed two values a byte, a float16 scale per group of 32 ------------------------------


def int4_vectors(rng):
    """[5, 3, 128] vectors (4 groups each): per group a magnitude from 1e-9 to 1e4, some groups
    all zero, an outlier element, one group near the largest float16 scale, one subnormal."""
    x = rng.standard_normal((5, 3, 4, 32)) * 10.0 ** rng.uniform(-9, 4, (5, 3, 4, 1))
    x[0, 0] = 0.0  # a whole vector
    x[0, 1, 2] = 0.0  # one group
    x[1, :, 1, 7] *= 100.0  # outlier element
    x[2, 0, 3] = rng.uniform(-1, 1, 32) * 4.5e5  # max|x| / 7 just under 65504
    x[2, 1, 0] = rng.uniform(-1, 1, 32) * 1e-40  # float32 subnormals
    x = jnp.asarray(x.reshape(5, 3, 128), jnp.float32)
    return x, np.asarray(x, np.float64)


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Hadamard matrix by its entries: H[i, j] = (-1)**popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    bits = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return (-1.0) ** bits / np.sqrt(n)


def test_int4_format_unpacks_by_hand():
    """The documented layout, decoded with numpy: byte j = (q_j + 8) | (q_{j + D/2} + 8) << 4,
    value = q * scale of its group of 32 elements, in the basis of x @ H (H Hadamard)."""
    x, x64 = int4_vectors(np.random.default_rng(3))
    h = hadamard(128)
    x64 = x64 @ h  # the basis int4 stores
    packed, scales = quantize(x, jnp.uint8)
    assert packed.dtype == jnp.uint8 and packed.shape == (5, 3, 64)
    assert scales.dtype == jnp.float16 and scales.shape == (5, 3, 4)
    b = np.asarray(packed).astype(np.int64)
    q = np.concatenate([b & 15, b >> 4], axis=-1) - 8  # [5, 3, 128]
    assert q.min() >= -7 and q.max() <= 7  # nibble 0 (-8) is never written
    s = np.asarray(scales, np.float64)
    by_hand = (q.reshape(5, 3, 4, 32) * s[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(dequantize(packed, scales, jnp.float32, rotated=True), np.float64),
                                  by_hand)
    np.testing.assert_allclose(np.asarray(dequantize(packed, scales, jnp.float32), np.float64), by_hand @ h,
                               rtol=1e-5, atol=1e-6 * np.abs(by_hand).max())  # rotated back: H is its own inverse
    # the abs-max element of each group lands on +-7 (every nonzero group uses the full range)
    amax = np.abs(x64.reshape(5, 3, 4, 32)).max(axis=-1)
    nonzero = amax > 7 * F16_TINY
    assert (np.abs(q.reshape(5, 3, 4, 32)).max(axis=-1)[nonzero] == 7).all()


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_int4_round_trip(x_dtype):
    x, _ = int4_vectors(np.random.default_rng(4))
    x = x.astype(x_dtype)
    x_in = np.asarray(x.astype(jnp.float32), np.float64)
    x64 = x_in @ hadamard(128)  # the bound holds per element in the stored (rotated) basis
    packed, scales = jax.jit(quantize, static_argnums=1)(x, jnp.uint8)
    s = np.asarray(scales, np.float64)  # the stored float16 scales
    amax = np.abs(x64.reshape(5, 3, 4, 32)).max(axis=-1)
    # stored scale: max|x| / 7 rounded to float16 (relative error <= 2**-11), floored at 2**-14
    exact = np.maximum(amax / 7, F16_TINY)
    assert (np.abs(s - exact) <= exact * 2.0**-11).all()
    assert (s >= F16_TINY).all() and np.isfinite(s).all()
    out = np.asarray(dequantize(packed, scales, jnp.float32, rotated=True), np.float64)
    err = np.abs(out - x64).reshape(5, 3, 4, 32)
    # the tested bound: half the stored scale per element (plus float32 rounding of x / s, of
    # the rotation's sums, and of float32's smallest normal, as XLA may flush subnormals to zero)
    bound = s[..., None] / 2 * (1 + 1e-6) + 1e-6 * np.abs(x64).max(axis=-1)[..., None, None] + F32_TINY
    assert (err <= bound).all(), (err / bound).max()
    # in the input's basis the rotation is orthonormal: each vector's error has the same L2 norm
    back = np.asarray(dequantize(packed, scales, jnp.float32), np.float64)
    np.testing.assert_allclose(np.linalg.norm(back - x_in, axis=-1), np.linalg.norm(out - x64, axis=-1),
                               rtol=1e-3, atol=1e-5 * np.abs(x64).max())
    # and in terms of the input: max|x| / 14 up to the float16 rounding of the scale
    assert (err <= np.maximum(amax / 14 * (1 + 2.0**-11), F16_TINY / 2)[..., None] * (1 + 1e-6) + F32_TINY).all()
    np.testing.assert_array_equal(back[0, 0], 0.0)  # a zero vector comes back as exact zeros
    bf16 = np.asarray(dequantize(packed, scales, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(bf16, np.asarray(jnp.asarray(back, jnp.float32).astype(jnp.bfloat16), np.float32))


def test_int4_saturates_past_the_largest_float16_scale():
    x = jnp.asarray(np.full((1, 64), 1e30), jnp.float32).at[0, 1].set(-1e30)
    out = np.asarray(dequantize(*quantize(x, jnp.uint8), jnp.float32, rotated=True))
    assert np.isfinite(out).all() and np.abs(out).max() == 7 * 65504.0


def test_int4_shapes_and_sizes():
    assert pool_dim(64, jnp.uint8) == 32 and pool_dim(128, jnp.uint8) == 64 and pool_dim(48, jnp.int8) == 48
    assert scales_shape((7, 16, 2, 32), jnp.uint8) == (7, 16, 2, 2)  # [.., D / 2] packed -> [.., D / 32]
    assert scales_shape((7, 16, 2, 64), jnp.int8) == (7, 16, 2)
    assert scales_dtype(jnp.uint8) == jnp.float16 and scales_dtype(jnp.float8_e4m3fn) == jnp.float32
    # bytes of one token of one kv head: D / 2 packed + a float16 per 32; int8 D + a float32; bf16 2 D
    assert token_bytes(64, jnp.uint8) == 32 + 2 * 2 and token_bytes(128, jnp.uint8) == 64 + 4 * 2
    assert token_bytes(64, jnp.int8) == 68 and token_bytes(64, jnp.bfloat16) == 128
    for bad in [16, 32, 96, 192]:
        with pytest.raises(ValueError, match="power-of-two head_dim of at least 64"):
            pool_dim(bad, jnp.uint8)
        with pytest.raises(ValueError, match="power-of-two head_dim of at least 64"):
            quantize(jnp.ones((2, bad)), jnp.uint8)
    packed, scales = quantize(jnp.ones((2, 64)), jnp.uint8)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(packed, scales[:, :1], jnp.float32)
    with pytest.raises(ValueError, match="float16"):
        dequantize(packed, scales.astype(jnp.float32), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(packed[:, :16], scales[:, :1], jnp.float32)


def test_check_kv_scales_int4():
    pool = jnp.zeros((3, 16, 2, 32), jnp.uint8)  # head_dim 64
    scales = jnp.ones((3, 16, 2, 2), jnp.float16)
    assert check_kv_scales(pool, scales, scales)
    with pytest.raises(ValueError, match="needs k_scales"):
        check_kv_scales(pool, None, None)
    with pytest.raises(ValueError, match=r"k_scales must be float16 \[3, 16, 2, 2\]"):
        check_kv_scales(pool, scales.astype(jnp.float32), scales)
    with pytest.raises(ValueError, match="v_scales must be float16"):
        check_kv_scales(pool, scales, scales[..., :1])
    with pytest.raises(ValueError, match="v_scales must be float16"):
        check_kv_scales(pool, scales, scales[..., 0])  # the int8 layout
    with pytest.raises(ValueError, match="multiple of 32"):
        check_kv_scales(pool[..., :16], scales[..., :1], scales[..., :1])
