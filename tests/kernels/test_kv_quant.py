"""Quantized KV storage: dtype names, and quantize/dequantize round trips against numpy bounds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import (KV_CACHE_DTYPES, check_kv_scales, dequantize,
                                     is_quantized, kv_storage_dtype, quantize)

F32_TINY = float(np.finfo(np.float32).tiny)


def test_storage_dtype_names():
    assert KV_CACHE_DTYPES == ("auto", "int8", "fp8")
    assert kv_storage_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_storage_dtype("auto", jnp.float32) == jnp.float32
    assert kv_storage_dtype("int8", jnp.bfloat16) == jnp.int8
    assert kv_storage_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn
    assert is_quantized(jnp.int8) and is_quantized(jnp.float8_e4m3fn)
    assert not is_quantized(jnp.bfloat16) and not is_quantized(jnp.float32)
    for bad in ["fp8_e5m2", "INT8", "float16", "", "int4"]:
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
        with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
            quantize(x, dtype)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(jnp.ones((2, 16), jnp.int32), jnp.int8)
    q, scale = quantize(x, jnp.int8)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
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
    with pytest.raises(ValueError, match="need an int8 or float8_e4m3fn pool"):
        check_kv_scales(pool.astype(jnp.float32), scales, scales)
    with pytest.raises(ValueError, match="v_scales must be float32"):
        check_kv_scales(pool, scales, scales[:, :8])
    with pytest.raises(ValueError, match="k_scales must be float32"):
        check_kv_scales(pool, scales.astype(jnp.bfloat16), scales)
