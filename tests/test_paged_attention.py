"""Paged decode attention: the Pallas kernel (interpret mode) and the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fake_device import lower_for_h200
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_xla

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

HEAD_DIM = 16
NUM_KV_HEADS = 2
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_paged_kv(rng, dtype, block_size, width, lengths):
    """Pool with each row's pages at random distinct blocks; every unused slot is NaN.

    Returns (k_pool, v_pool, block_tables, contiguous k, contiguous v) with the contiguous
    K/V per row as float64 numpy [L, Hkv, D].
    """
    batch = len(lengths)
    num_blocks = 1 + batch * width  # block 0: the dummy block
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_pool = np.full(shape, np.nan, np.float32)
    v_pool = np.full(shape, np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((batch, width), np.int32)
    ks, vs = [], []
    for b, length in enumerate(lengths):
        k = rng.standard_normal((length, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((length, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
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
    out = paged_decode_attention_xla(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_kernel_matches_xla_path():
    args, _ = make_case(4, jnp.bfloat16, 64, 3, 4, [0, 7, 64, 130, 256, 200])
    out = paged_decode_attention(*args, interpret=True, block_k=32)
    ref = paged_decode_attention_xla(*args)
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
