"""Paged decode attention: the Pallas kernel (interpret mode) and the XLA path."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200 import lower_for_h200
from test_kv_quant import hadamard

from pallas_kernels.kv_pool import KVPool
from pallas_kernels.kv_quant import dequantize, quantize
from pallas_kernels.paged_attention import paged_decode_attention
from zipage_jax.layers.xla_paged_attention import paged_attention, paged_decode_attention_reference

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

HEAD_DIM = 16
NUM_KV_HEADS = 2
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_paged_kv(rng, dtype, block_size, width, lengths, head_dim=HEAD_DIM):
    """Pool with each row's pages at random distinct blocks; every unused slot is NaN.

    Returns (k_pool, v_pool, block_tables, contiguous k, contiguous v) with the contiguous
    K/V per row as float64 numpy [L, Hkv, D].
    """
    batch = len(lengths)
    num_blocks = 1 + batch * width  # block 0: the dummy block
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_pool = np.full(shape, np.nan, np.float32)
    v_pool = np.full(shape, np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((batch, width), np.int32)
    ks, vs = [], []
    for b, length in enumerate(lengths):
        k = rng.standard_normal((length, NUM_KV_HEADS, head_dim)).astype(np.float32)
        v = rng.standard_normal((length, NUM_KV_HEADS, head_dim)).astype(np.float32)
        for j in range(-(-length // block_size)):
            block = block_tables[b, j] = free.pop()
            rows = slice(j * block_size, (j + 1) * block_size)
            k_pool[block, : len(k[rows])] = k[rows]
            v_pool[block, : len(v[rows])] = v[rows]
        # the kernel sees the pool in `dtype`: compare against the rounded values
        ks.append(np.asarray(jnp.asarray(k, dtype), np.float64))
        vs.append(np.asarray(jnp.asarray(v, dtype), np.float64))
    return (jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype), jnp.asarray(block_tables),
            ks, vs)


def naive_attention(q, k, v, scale):
    # q: [Hq, D]; k, v: [L, Hkv, D] contiguous; float64
    if len(k) == 0:
        return np.zeros_like(q)
    group = q.shape[0] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [L, Hq, D]
    s = np.einsum("hd,lhd->hl", q, k) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("hl,lhd->hd", p / p.sum(axis=1, keepdims=True), v)


def make_case(seed, dtype, block_size, group, width, lengths):
    rng = np.random.default_rng(seed)
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, dtype, block_size, width, lengths)
    q = jnp.asarray(rng.standard_normal((len(lengths), group * NUM_KV_HEADS, HEAD_DIM)), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    q64 = np.asarray(q, np.float64)
    expected = np.stack([naive_attention(q64[b], ks[b], vs[b], HEAD_DIM**-0.5)
                         for b in range(len(lengths))])
    return (q, k_pool, v_pool, tables, lens), expected


def ragged_lengths(block_size, width):
    # padding row, one token, exact block multiple, partial last block, full table
    return [0, 1, block_size, 2 * block_size - 3, width * block_size]


@pytest.mark.parametrize(
    "dtype, block_size, group",
    [(jnp.float32, 16, 1), (jnp.bfloat16, 16, 4), (jnp.float32, 64, 3), (jnp.bfloat16, 64, 8),
     (jnp.float32, 256, 8), (jnp.bfloat16, 256, 3), (jnp.float32, 256, 4)],
)
def test_kernel_matches_naive(dtype, block_size, group):
    width = 4 if block_size < 256 else 2
    args, expected = make_case(0, dtype, block_size, group, width,
                               ragged_lengths(block_size, width))
    out = paged_decode_attention(*args, interpret=True)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # padding row


@pytest.mark.parametrize("block_k, k_splits", [(16, 1), (16, 4), (32, 2), (64, 8)])
def test_kernel_page_splits(block_k, k_splits):
    # several inner steps and splits, including splits that start past a row's length
    lengths = [5, 16, 47, 96, 128, 0]
    args, expected = make_case(1, jnp.float32, 16, 4, 8, lengths)
    out = paged_decode_attention(*args, interpret=True, block_k=block_k, k_splits=k_splits)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def test_kernel_scale_and_wide_group():
    # group 32 > 16: the tile grows to 32 rows
    args, expected = make_case(2, jnp.float32, 16, 32, 2, [3, 32])
    q = args[0]
    out = paged_decode_attention(q * 2, *args[1:], scale=HEAD_DIM**-0.5 / 2, interpret=True)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, block_size, group",
    [(jnp.float32, 16, 1), (jnp.float32, 64, 3), (jnp.bfloat16, 256, 8)],
)
def test_xla_path_matches_naive(dtype, block_size, group):
    width = 4 if block_size < 256 else 2
    args, expected = make_case(3, dtype, block_size, group, width,
                               ragged_lengths(block_size, width))
    out = paged_decode_attention_reference(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_kernel_matches_xla_path():
    args, _ = make_case(4, jnp.bfloat16, 64, 3, 4, [0, 7, 64, 130, 256, 200])
    out = paged_decode_attention(*args, interpret=True, block_k=32)
    ref = paged_decode_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_kv_heads, q_heads, width, batch, tuning",
    [(jnp.bfloat16, 64, 256, 3, 9, 8, 64, {}),
     (jnp.float32, 16, 16, 4, 8, 3, 5, {"block_k": 256, "num_warps": 8}),
     (jnp.bfloat16, 128, 16, 8, 64, 64, 1, {"block_k": 64, "k_splits": 4})],
)
def test_kernel_lowers_for_triton(dtype, head_dim, block_size, num_kv_heads, q_heads, width,
                                  batch, tuning):
    # Lowering to Triton IR on CPU checks the GPU rules (power-of-two tiles, dot operands).
    q = jax.ShapeDtypeStruct((batch, q_heads, head_dim), dtype)
    pool = jax.ShapeDtypeStruct((1 + batch * width, block_size, num_kv_heads, head_dim), dtype)
    tables = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    text = lower_for_h200(paged_decode_attention, q, pool, pool, tables, lens, **tuning)
    assert "__gpu$xla.gpu.triton" in text


def quantized_case(seed, pool_dtype, q_dtype, block_size, group, width, lengths, head_dim=HEAD_DIM):
    """A quantized pool (unused slots: NaN scales, NaN e4m3 values, int8 -128, int4 nibbles 0 = -8)
    and a bound on how far the attention over it may lie from float64 attention over the
    unquantized K/V.

    Returns (q, k_pool, v_pool, tables, lens), (k_scales, v_scales), expected [B, Hq, D], and
    bound [B, Hq, D]. The bound is derived from the round-trip bound |k - k~| <= dk per
    element: each logit moves by at most E = scale * sum_d |q_d| dk_d, so the probabilities
    move by at most exp(2E) - 1 in L1, and the output by (exp(2E) - 1) max|v| + max dv.
    """
    rng = np.random.default_rng(seed)
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, block_size, width, lengths, head_dim)
    q = jnp.asarray(rng.standard_normal((len(lengths), group * NUM_KV_HEADS, head_dim)), q_dtype)
    unused = np.isnan(np.asarray(k_pool)).any(axis=-1)[..., None]  # [num_blocks, BS, Hkv, 1]
    garbage = jnp.asarray({jnp.int8: -128, jnp.uint8: 0}.get(pool_dtype, np.nan), pool_dtype)
    (kq, k_scales), (vq, v_scales) = [
        (jnp.where(unused, garbage, x_q), jnp.where(unused if x_scale.ndim == 4 else unused[..., 0], np.nan, x_scale))
        for x_q, x_scale in (quantize(jnp.nan_to_num(pool), pool_dtype)
                             for pool in (k_pool, v_pool))]
    q64 = np.asarray(q, np.float64)
    scale = head_dim**-0.5
    expected, bound = [], []
    for b in range(len(lengths)):
        qg = q64[b].reshape(NUM_KV_HEADS, group, head_dim)
        expected.append(naive_attention(q64[b], ks[b], vs[b], scale))
        if not lengths[b]:
            bound.append(np.zeros_like(q64[b]))
            continue
        dk, dv = (round_trip_bound(x, pool_dtype) for x in (ks[b], vs[b]))  # [L, Hkv, D]
        logit_err = scale * np.einsum("hgd,lhd->hgl", np.abs(qg), dk).max(axis=-1)  # [Hkv, G]
        v_max, dv_max = np.abs(vs[b]).max(axis=0), dv.max(axis=0)  # [Hkv, D]
        row = np.expm1(2 * logit_err)[..., None] * v_max[:, None] + dv_max[:, None]
        bound.append(row.reshape(q64[b].shape))
    return ((q, kq, vq, tables, jnp.asarray(lengths, jnp.int32)), (k_scales, v_scales),
            np.stack(expected), np.stack(bound))


def round_trip_bound(x, pool_dtype):
    # x: [L, Hkv, D] float64; the per-element quantization error bound (tests/kernels/test_kv_quant.py)
    if pool_dtype == jnp.uint8:
        # int4: half the float16-rounded scale of each group of 32 of x @ H (the stored basis, H
        # the orthonormal Hadamard matrix, its own inverse); back in x's basis an element's error
        # is sum_i e_i H[i, j], so at most the sum of those bounds / sqrt(D)
        d = x.shape[-1]
        h = hadamard(d)
        groups = np.abs(x @ h).reshape(*x.shape[:-1], -1, 32)
        amax = np.maximum(groups.max(axis=-1, keepdims=True) / 14 * (1 + 2.0**-11), 2.0**-15)
        total = np.broadcast_to(amax, groups.shape).sum(axis=(-2, -1), keepdims=True)[..., 0] / np.sqrt(d)
        return np.broadcast_to(total, x.shape)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    if pool_dtype == jnp.int8:
        return np.broadcast_to(amax / 254, x.shape)
    return np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * amax / 448)


QUANT_CASES = [  # pool dtype, q dtype, block size, group, block_k
    (jnp.int8, jnp.float32, 16, 1, 128),
    (jnp.int8, jnp.bfloat16, 64, 3, 16),  # scales split with the pool into 16-token pages
    (jnp.float8_e4m3fn, jnp.bfloat16, 16, 4, 128),
    (jnp.float8_e4m3fn, jnp.float32, 256, 3, 128),  # 256-token blocks: two 128-token pages
    (jnp.int8, jnp.bfloat16, 256, 4, 128),
    (jnp.float8_e4m3fn, jnp.bfloat16, 64, 1, 128),
]
QUANT_GRID = [pytest.param(*case, marks=pytest.mark.slow)
              for case in itertools.product([jnp.int8, jnp.float8_e4m3fn],
                                            [jnp.float32, jnp.bfloat16], [16, 64, 256], [1, 3, 4],
                                            [16, 128])
              if case not in QUANT_CASES]


@pytest.mark.parametrize("pool_dtype, q_dtype, block_size, group, block_k",
                         QUANT_CASES + QUANT_GRID)
def test_kernel_quantized_pool(pool_dtype, q_dtype, block_size, group, block_k):
    width = 4 if block_size < 256 else 2
    args, (k_scales, v_scales), expected, bound = quantized_case(
        6, pool_dtype, q_dtype, block_size, group, width, ragged_lengths(block_size, width))
    q, kq, vq, tables, lens = args
    out = paged_decode_attention(*args, k_scales=k_scales, v_scales=v_scales, interpret=True,
                                 block_k=block_k)
    assert out.shape == q.shape and out.dtype == q_dtype
    out64 = np.asarray(out, np.float64)
    assert np.isfinite(out64).all()
    np.testing.assert_array_equal(out64[0], 0.0)  # padding row
    # tight: the XLA path over the dequantized pool sees the same values
    ref = paged_decode_attention_reference(q, dequantize(kq, k_scales, q_dtype),
                                           dequantize(vq, v_scales, q_dtype), tables, lens)
    np.testing.assert_allclose(out64, np.asarray(ref, np.float64),
                               atol=TOLERANCE[q_dtype], rtol=TOLERANCE[q_dtype])
    # loose: within the quantization error of attention over the unquantized K/V
    err = np.abs(out64 - expected)
    assert (err <= bound + TOLERANCE[q_dtype]).all(), (err - bound).max()


@pytest.mark.parametrize(
    "pool_dtype, head_dim, block_size",
    list(itertools.product([jnp.int8, jnp.float8_e4m3fn], [64, 128], [16, 256])))
def test_quantized_kernel_lowers_for_triton(pool_dtype, head_dim, block_size):
    batch, width, num_kv_heads, q_heads = 8, 4, 4, 12
    q = jax.ShapeDtypeStruct((batch, q_heads, head_dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((1 + batch * width, block_size, num_kv_heads, head_dim),
                                pool_dtype)
    scales = jax.ShapeDtypeStruct(pool.shape[:3], jnp.float32)
    tables = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    text = lower_for_h200(paged_decode_attention, q, pool, pool, tables, lens, k_scales=scales, v_scales=scales)
    assert "__gpu$xla.gpu.triton" in text


INT4_CASES = [  # head dim, block size, group, q dtype, block_k
    (64, 16, 1, jnp.float32, 128),
    (128, 32, 3, jnp.bfloat16, 16),  # 32-token blocks read as 16-token pages, scales split with them
    (64, 32, 4, jnp.bfloat16, 128),
    (128, 16, 4, jnp.float32, 32),
]
INT4_GRID = [pytest.param(*case, marks=pytest.mark.slow)
             for case in itertools.product([64, 128], [16, 32], [1, 3, 4], [jnp.float32, jnp.bfloat16], [16, 128])
             if case not in INT4_CASES]


@pytest.mark.parametrize("head_dim, block_size, group, q_dtype, block_k", INT4_CASES + INT4_GRID)
def test_kernel_int4_pool(head_dim, block_size, group, q_dtype, block_k):
    width = 4
    args, (k_scales, v_scales), expected, bound = quantized_case(
        8, jnp.uint8, q_dtype, block_size, group, width, ragged_lengths(block_size, width), head_dim)
    q, kq, vq, tables, lens = args
    assert kq.shape[-1] == head_dim // 2 and k_scales.shape[-1] == head_dim // 32
    out = paged_decode_attention(*args, k_scales=k_scales, v_scales=v_scales, interpret=True, block_k=block_k)
    assert out.shape == q.shape and out.dtype == q_dtype
    out64 = np.asarray(out, np.float64)
    assert np.isfinite(out64).all()
    np.testing.assert_array_equal(out64[0], 0.0)  # padding row
    # tight: the XLA path over the same int4 pool (it unpacks and dequantizes the gathered pages)
    ref, _ = paged_attention(q[:, None], KVPool(kq, vq, k_scales, v_scales), tables, lens[:, None])
    np.testing.assert_allclose(out64, np.asarray(ref[:, 0], np.float64),
                               atol=TOLERANCE[q_dtype], rtol=TOLERANCE[q_dtype])
    # loose: within the quantization error of attention over the unquantized K/V
    err = np.abs(out64 - expected)
    assert (err <= bound + TOLERANCE[q_dtype]).all(), (err - bound).max()


@pytest.mark.parametrize("head_dim, block_size, tuning", [(64, 16, {}), (128, 256, {"block_k": 64, "k_splits": 4})])
def test_int4_kernel_lowers_for_triton(head_dim, block_size, tuning):
    batch, width, num_kv_heads, q_heads = 8, 4, 4, 12
    q = jax.ShapeDtypeStruct((batch, q_heads, head_dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((1 + batch * width, block_size, num_kv_heads, head_dim // 2), jnp.uint8)
    scales = jax.ShapeDtypeStruct((*pool.shape[:3], head_dim // 32), jnp.float16)
    tables = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    text = lower_for_h200(paged_decode_attention, q, pool, pool, tables, lens, k_scales=scales, v_scales=scales,
                          **tuning)
    assert "__gpu$xla.gpu.triton" in text


def test_int4_bad_inputs_raise():
    (q, kq, vq, tables, lens), (ks, vs), _, _ = quantized_case(9, jnp.uint8, jnp.float32, 16, 2, 2, [3, 4], 64)
    call = functools.partial(paged_decode_attention, interpret=True)
    with pytest.raises(ValueError, match="k_scales must be float16"):
        call(q, kq, vq, tables, lens, k_scales=ks[..., 0].astype(jnp.float32), v_scales=vs)
    with pytest.raises(ValueError, match="does not fit"):  # a head_dim 128 query on a head_dim 64 pool
        call(jnp.concatenate([q, q], axis=-1), kq, vq, tables, lens, k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="power-of-two head_dim of at least 64"):
        call(q[..., :32], kq[..., :16], vq[..., :16], tables, lens, k_scales=ks[..., :1], v_scales=vs[..., :1])


def test_quantized_bad_inputs_raise():
    (q, kq, vq, tables, lens), (ks, vs), _, _ = quantized_case(7, jnp.int8, jnp.float32, 16, 2,
                                                               2, [3, 4])
    call = functools.partial(paged_decode_attention, interpret=True)
    with pytest.raises(ValueError, match="together"):
        call(q, kq, vq, tables, lens, k_scales=ks)
    with pytest.raises(ValueError, match="needs k_scales"):
        call(q, kq, vq, tables, lens)
    with pytest.raises(ValueError, match="need an int8, float8_e4m3fn or uint8"):
        call(q, kq.astype(jnp.float32), vq.astype(jnp.float32), tables, lens, k_scales=ks,
             v_scales=vs)
    with pytest.raises(ValueError, match="v_scales must be float32"):
        call(q, kq, vq, tables, lens, k_scales=ks, v_scales=vs[:, :8])
    with pytest.raises(ValueError, match="k_scales must be float32"):
        call(q, kq, vq, tables, lens, k_scales=ks.astype(jnp.bfloat16), v_scales=vs)
    with pytest.raises(ValueError, match="q dtype must be"):
        call(q.astype(jnp.int8), kq, vq, tables, lens, k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="dtypes differ"):
        call(q, kq, vq.astype(jnp.float8_e4m3fn), tables, lens, k_scales=ks, v_scales=vs)


def test_bad_inputs_raise():
    (q, k_pool, v_pool, tables, lens), _ = make_case(5, jnp.float32, 16, 2, 2, [3, 4])
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k_pool, v_pool, tables.astype(jnp.int16), lens, interpret=True)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, k_pool, v_pool, tables, lens[:1], interpret=True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention(q[:, :3], k_pool, v_pool, tables, lens, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.astype(jnp.bfloat16), k_pool, v_pool, tables, lens,
                               interpret=True)
    with pytest.raises(ValueError, match="block size"):
        paged_decode_attention(q, k_pool[:, :12], v_pool[:, :12], tables, lens, interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        paged_decode_attention(q, k_pool, v_pool, tables, lens, interpret=True, block_k=24)
