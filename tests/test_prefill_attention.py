"""Paged prefill attention (XLA): new tokens over cached prefix pages plus their own."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prefill_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from test_paged_attention import HEAD_DIM, NUM_KV_HEADS, make_paged_kv, naive_attention


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
            expected[b, c] = naive_attention(q64[b, c], ks[b][:seen], vs[b][:seen],
                                             HEAD_DIM**-0.5)
    return (q, k_pool, v_pool, tables, jnp.asarray(kv_lens)), expected


@pytest.mark.parametrize(
    "dtype, block_size, group, tol",
    [(jnp.float32, 16, 1, 1e-5), (jnp.float32, 64, 3, 1e-5), (jnp.bfloat16, 16, 4, 2e-2),
     (jnp.bfloat16, 256, 8, 2e-2)],
)
def test_prefill_matches_per_token_loop(dtype, block_size, group, tol):
    # rows: fresh prompt, cached prefix + chunk, chunk ending on a block edge, padding row
    prefix = [0, block_size + 5, block_size - 4, 0]
    new = [7, 8, 4, 0]
    args, expected = make_chunk(0, dtype, block_size, group, 3, prefix, new, 8)
    out = paged_prefill_attention(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # padding row
    np.testing.assert_array_equal(np.asarray(out[2, 4:], np.float32), 0.0)  # padding tokens


def test_prefill_many_steps(monkeypatch):
    # a tiny logits budget forces one page per loop step; the loop stops at the longest row
    batch, chunk, group, block_size = 4, 4, 2, 16
    monkeypatch.setattr(prefill_attention, "_LOGITS_BUDGET",
                        batch * chunk * NUM_KV_HEADS * group * block_size)
    args, expected = make_chunk(1, jnp.float32, 16, 2, 6, [20, 0, 33, 3], [4, 4, 1, 2], 4)
    out = paged_prefill_attention.__wrapped__(*args)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def test_prefill_bad_inputs_raise():
    (q, k_pool, v_pool, tables, kv_lens), _ = make_chunk(2, jnp.float32, 16, 2, 2, [1], [2], 2)
    with pytest.raises(ValueError, match="kv_lens"):
        paged_prefill_attention(q, k_pool, v_pool, tables, kv_lens[:, :1])
    with pytest.raises(ValueError, match=r"\[B, C, Hq, D\]"):
        paged_prefill_attention(q[0], k_pool, v_pool, tables, kv_lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(q[..., :8], k_pool, v_pool, tables, kv_lens)
    with pytest.raises(ValueError, match="v_pool"):
        paged_prefill_attention(q, k_pool, v_pool[:, :8], tables, kv_lens)
