"""Attention sinks (gpt-oss): per query head one logit in the softmax's denominator, no value, in
the Pallas decode kernel (interpret mode), the XLA loop (decode and prefill chunks, with a sliding
window) and the dense causal attention, against a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import HEAD_DIM, NUM_KV_HEADS, make_paged_kv

from pallas_kernels.kv_pool import KVPool
from pallas_kernels.paged_attention import paged_decode_attention
from zipage_jax.layers.attention import causal_attention
from zipage_jax.layers.xla_paged_attention import paged_attention, paged_decode_attention_reference

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

GROUP = 2
HQ = GROUP * NUM_KV_HEADS
SCALE = 0.3
LENGTHS = [0, 5, 24, 41, 100]  # a padding row, rows shorter and longer than the window below
SINKS = np.asarray([0.5, -1.0, 2.0, 4.0, -3.0, 1.0, 0.0, 3.0][:HQ], np.float32)


def sink_attention(q, k, v, sinks, scale=SCALE):
    """float64: q [Hq, D] over k, v [L, Hkv, D] with a sink logit per head; zeros for L = 0."""
    if len(k) == 0:
        return np.zeros_like(q)
    k, v = np.repeat(k, q.shape[0] // k.shape[1], axis=1), np.repeat(v, q.shape[0] // v.shape[1], axis=1)
    s = np.einsum("hd,lhd->hl", q, k) * scale
    m = np.maximum(s.max(axis=1), sinks)
    p = np.exp(s - m[:, None])
    return np.einsum("hl,lhd->hd", p, v) / (p.sum(axis=1) + np.exp(sinks - m))[:, None]


def decode_case(seed, lengths, width=8):
    rng = np.random.default_rng(seed)
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, 16, width, lengths)
    q = rng.standard_normal((len(lengths), HQ, HEAD_DIM)).astype(np.float32)
    return (jnp.asarray(q), k_pool, v_pool, tables, jnp.asarray(lengths, jnp.int32)), (q, ks, vs)


def expected(ref, lengths, sinks, window=0):
    q, ks, vs = ref
    lows = [max(0, n - window) if window else 0 for n in lengths]
    return np.stack([sink_attention(q[b].astype(np.float64), ks[b][lo:n], vs[b][lo:n], sinks.astype(np.float64))
                     for b, (n, lo) in enumerate(zip(lengths, lows))])


def decode_paths(args, **options):
    return {"pallas": paged_decode_attention(*args, scale=SCALE, interpret=True, block_k=16, k_splits=4, **options),
            "xla": paged_decode_attention_reference(*args, scale=SCALE, **options)}


@pytest.mark.parametrize("window", [0, 24])
def test_decode_with_sinks_matches_numpy(window):
    args, ref = decode_case(0, LENGTHS)
    for name, out in decode_paths(args, sinks=jnp.asarray(SINKS), window=window).items():
        np.testing.assert_allclose(np.asarray(out), expected(ref, LENGTHS, SINKS, window), atol=1e-5, rtol=1e-5,
                                   err_msg=name)
        np.testing.assert_array_equal(np.asarray(out[0]), 0.0)  # padding row


def test_sinks_of_minus_infinity_are_no_sinks_and_large_ones_shrink_the_output():
    args, ref = decode_case(1, LENGTHS)
    plain = decode_paths(args)
    for name, out in decode_paths(args, sinks=jnp.full((HQ,), -jnp.inf)).items():
        np.testing.assert_allclose(np.asarray(out), np.asarray(plain[name]), atol=1e-6, err_msg=name)
    big = np.full((HQ,), 30.0, np.float32)  # the sink takes nearly all the probability mass
    for name, out in decode_paths(args, sinks=jnp.asarray(big)).items():
        np.testing.assert_allclose(np.asarray(out), expected(ref, LENGTHS, big), atol=1e-5, err_msg=name)
        assert np.abs(np.asarray(out)).max() < 1e-6 < np.abs(np.asarray(plain[name])[1:]).min()


@pytest.mark.parametrize("window", [0, 9])
def test_xla_prefill_chunks_with_sinks_match_numpy(window):
    rng = np.random.default_rng(3)
    lengths, chunk = [70, 40, 100], 12
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, 16, 8, lengths)
    kv_lens = np.asarray([[n - chunk + 1 + c for c in range(chunk)] for n in lengths], np.int32)
    kv_lens[1, -1] = 0  # a padding token
    q = rng.standard_normal((len(lengths), chunk, HQ, HEAD_DIM)).astype(np.float32)
    out, _ = paged_attention(jnp.asarray(q), KVPool(k_pool, v_pool), tables, jnp.asarray(kv_lens), scale=SCALE,
                             step_tokens=32, window=window, sinks=jnp.asarray(SINKS))
    for b in range(len(lengths)):
        for c in range(chunk):
            n = kv_lens[b, c]
            lo = max(0, n - window) if window else 0
            want = sink_attention(q[b, c].astype(np.float64), ks[b][lo:n], vs[b][lo:n], SINKS.astype(np.float64))
            np.testing.assert_allclose(np.asarray(out[b, c]), want, atol=1e-5, rtol=1e-5)


def test_dense_causal_attention_with_sinks_matches_numpy():
    rng = np.random.default_rng(4)
    B, T, D, window = 2, 11, 8, 4
    q, k, v = (rng.standard_normal((B, T, h, D)).astype(np.float32) for h in (HQ, NUM_KV_HEADS, NUM_KV_HEADS))
    out, _ = causal_attention(0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, window=window, scale=SCALE,
                              sinks=jnp.asarray(SINKS))
    for b in range(B):
        for t in range(T):
            lo = max(0, t + 1 - window)
            want = sink_attention(q[b, t].astype(np.float64), k[b, lo:t + 1], v[b, lo:t + 1], SINKS.astype(np.float64))
            np.testing.assert_allclose(np.asarray(out[b, t]), want, atol=1e-5, rtol=1e-5)
    plain, _ = causal_attention(0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, window=window, scale=SCALE)
    assert np.abs(np.asarray(plain) - np.asarray(out)).max() > 1e-2  # positive control: the sinks count


def test_sinks_of_the_wrong_shape_are_refused():
    args, _ = decode_case(5, [5], width=1)
    for path in (paged_decode_attention_reference, lambda *a, **o: paged_decode_attention(*a, interpret=True, **o)):
        with pytest.raises(ValueError, match=r"sinks must be float \[Hq=4\]"):
            path(*args, sinks=jnp.zeros((HQ + 1,)))
