"""Paged attention in XLA: C tokens per row over their pages, writing the new K/V in its loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import HEAD_DIM, NUM_KV_HEADS, make_paged_kv, naive_attention, round_trip_bound

from pallas_kernels import kv_quant
from pallas_kernels.kv_pool import KVPool
from zipage_jax.layers.xla_paged_attention import NewKV, paged_attention


def make_chunk(seed, dtype, block_size, group, width, prefix_lens, new_lens, chunk):
    """Row b holds prefix_lens[b] cached tokens, then new_lens[b] <= chunk new tokens."""
    rng = np.random.default_rng(seed)
    totals = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, dtype, block_size, width, totals)
    q_heads = group * NUM_KV_HEADS
    q = jnp.asarray(rng.standard_normal((len(totals), chunk, q_heads, HEAD_DIM)), dtype)
    kv_lens = np.zeros((len(totals), chunk), np.int32)
    for b, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        kv_lens[b, :n] = p + 1 + np.arange(n)
    # one token at a time, over the contiguous K/V it may see
    q64 = np.asarray(q, np.float64)
    expected = np.zeros(q.shape)
    for b in range(len(totals)):
        for c, seen in enumerate(kv_lens[b]):
            expected[b, c] = naive_attention(q64[b, c], ks[b][:seen], vs[b][:seen], HEAD_DIM**-0.5)
    return (q, KVPool(k_pool, v_pool), tables, jnp.asarray(kv_lens)), expected


@pytest.mark.parametrize(
    "dtype, block_size, group, tol",
    [(jnp.float32, 16, 1, 1e-5), (jnp.float32, 64, 3, 1e-5), (jnp.bfloat16, 16, 4, 2e-2),
     (jnp.bfloat16, 256, 8, 2e-2)],
)
def test_matches_per_token_loop(dtype, block_size, group, tol):
    # rows: fresh prompt, cached prefix + chunk, chunk ending on a block edge, padding row
    prefix = [0, block_size + 5, block_size - 4, 0]
    new = [7, 8, 4, 0]
    args, expected = make_chunk(0, dtype, block_size, group, 3, prefix, new, 8)
    out, _ = paged_attention(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # padding row
    np.testing.assert_array_equal(np.asarray(out[2, 4:], np.float32), 0.0)  # padding tokens


@pytest.mark.parametrize("step_tokens", [16, 32, 256])
def test_any_step_size_and_wide_tables(step_tokens):
    # one page per step up to the whole row in one step; the table is far wider than any row
    args, expected = make_chunk(1, jnp.float32, 16, 2, 12, [20, 0, 33, 3], [4, 4, 1, 2], 4)
    out, _ = paged_attention(*args, step_tokens=step_tokens)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def test_new_kv_is_written_before_it_is_read():
    # rows 0 and 1 are two halves of one sequence's chunk: row 1 must see row 0's new keys
    rng = np.random.default_rng(3)
    block_size, group, prefix, chunk = 16, 2, 5, 6
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, block_size, 2, [prefix + 2 * chunk])
    tables = np.repeat(tables, 2, axis=0)  # both rows read the same sequence
    slots = np.arange(prefix, prefix + 2 * chunk).reshape(2, chunk)
    flat = tables[0][slots // block_size] * block_size + slots % block_size
    new_k = ks[0][prefix:].reshape(2, chunk, NUM_KV_HEADS, HEAD_DIM)
    new_v = vs[0][prefix:].reshape(2, chunk, NUM_KV_HEADS, HEAD_DIM)
    k_pool, v_pool = np.array(k_pool), np.array(v_pool)
    for pool in (k_pool, v_pool):  # the new tokens' slots hold garbage until written
        pool.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[flat.reshape(-1)] = 1e4
    q = rng.standard_normal((2, chunk, group * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    kv_lens = (slots + 1).astype(np.int32)
    new = NewKV(jnp.asarray(flat, jnp.int32), jnp.asarray(new_k, jnp.float32), jnp.asarray(new_v, jnp.float32))
    out, pools = paged_attention(jnp.asarray(q), KVPool(jnp.asarray(k_pool), jnp.asarray(v_pool)), jnp.asarray(tables),
                                 jnp.asarray(kv_lens), new)
    for r in range(2):
        for c in range(chunk):
            seen = kv_lens[r, c]
            np.testing.assert_allclose(np.asarray(out[r, c]), naive_attention(q[r, c].astype(np.float64), ks[0][:seen],
                                                                                vs[0][:seen], HEAD_DIM**-0.5),
                                       atol=1e-5, rtol=1e-5)
    written = np.asarray(pools.k).reshape(-1, NUM_KV_HEADS, HEAD_DIM)[flat.reshape(-1)]
    np.testing.assert_array_equal(written, new_k.reshape(-1, NUM_KV_HEADS, HEAD_DIM).astype(np.float32))


def test_writing_in_the_loop_copies_no_pool():
    # XLA keeps the donated pools in place: no copy of a pool-sized buffer in the compiled step
    args, _ = make_chunk(4, jnp.float32, 16, 2, 4, [10, 3], [2, 2], 2)
    q, pools, tables, kv_lens = args
    new = NewKV(jnp.zeros(kv_lens.shape, jnp.int32), jnp.zeros((2, 2, NUM_KV_HEADS, HEAD_DIM)),
                jnp.zeros((2, 2, NUM_KV_HEADS, HEAD_DIM)))
    step = jax.jit(lambda pools, q, t, l, n: paged_attention(q, pools, t, l, n), donate_argnums=0)
    hlo = step.lower(pools, q, tables, kv_lens, new).compile().as_text()
    pool_type = f"f32[{','.join(map(str, pools.k.shape))}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and pool_type in line]
    assert copies == []


@pytest.mark.parametrize("kv_dtype, head_dim", [(jnp.int8, HEAD_DIM), (jnp.float8_e4m3fn, HEAD_DIM), (jnp.uint8, 64),
                                                (jnp.uint8, 128)])
def test_quantized_pools_attend_like_their_dequantized_values(kv_dtype, head_dim):
    # writing through a quantized pool = quantize, then attend over the dequantized pool
    # (uint8: packed int4 [.., D / 2] with float16 scales [.., D / 32])
    rng = np.random.default_rng(5)
    block_size, group, prefix, chunk = 16, 3, 9, 4
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, block_size, 3, [prefix + chunk], head_dim)
    k_pool = np.nan_to_num(np.asarray(k_pool))
    v_pool = np.nan_to_num(np.asarray(v_pool))
    kq, ksc = kv_quant.quantize(jnp.asarray(k_pool), kv_dtype)
    vq, vsc = kv_quant.quantize(jnp.asarray(v_pool), kv_dtype)
    slots = prefix + np.arange(chunk)
    flat = (tables[0][slots // block_size] * block_size + slots % block_size)[None].astype(np.int32)
    new_k = jnp.asarray(ks[0][prefix:][None], jnp.float32)
    new_v = jnp.asarray(vs[0][prefix:][None], jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, chunk, group * NUM_KV_HEADS, head_dim)), jnp.float32)
    kv_lens = jnp.asarray((slots + 1)[None], jnp.int32)
    out, pools = paged_attention(q, KVPool(kq, vq, ksc, vsc), jnp.asarray(tables), kv_lens,
                                 NewKV(jnp.asarray(flat), new_k, new_v))
    assert pools.k.dtype == kv_dtype and pools.k.shape[-1] == kv_quant.pool_dim(head_dim, kv_dtype)
    assert pools.k_scales.dtype == kv_quant.scales_dtype(kv_dtype) and pools.k_scales.shape == ksc.shape
    dk = kv_quant.dequantize(pools.k, pools.k_scales, jnp.float32)
    dv = kv_quant.dequantize(pools.v, pools.v_scales, jnp.float32)
    expected, _ = paged_attention(q, KVPool(dk, dv), jnp.asarray(tables), kv_lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5, rtol=1e-5)
    # and the new tokens were quantized on the way in: within the round-trip bound
    got_k = np.asarray(dk).reshape(-1, NUM_KV_HEADS, head_dim)[flat[0]]
    new_k64 = np.asarray(new_k[0], np.float64)
    assert (np.abs(got_k - new_k64) <= round_trip_bound(new_k64, kv_dtype) * (1 + 1e-5) + 1e-6).all()


def test_bad_inputs_raise():
    (q, pools, tables, kv_lens), _ = make_chunk(2, jnp.float32, 16, 2, 2, [1], [2], 2)
    with pytest.raises(ValueError, match="kv_lens"):
        paged_attention(q, pools, tables, kv_lens[:, :1])
    with pytest.raises(ValueError, match=r"\[B, C, Hq, D\]"):
        paged_attention(q[0], pools, tables, kv_lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :8], pools, tables, kv_lens)
    with pytest.raises(ValueError, match="v_pool"):
        paged_attention(q, pools._replace(v=pools.v[:, :8]), tables, kv_lens)
    with pytest.raises(ValueError, match="multiple of the page"):
        paged_attention(q, pools, tables, kv_lens, step_tokens=24)
