"""Sliding-window attention in the paged kernels: a token with kv_len n sees only slots
n - window .. n - 1, in the XLA loop (prefill chunks and decode) and the Pallas decode kernel
(interpret mode), against a float64 numpy reference that slices the window out of contiguous K/V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200 import lower_for_h200
from test_paged_attention import HEAD_DIM, NUM_KV_HEADS, make_paged_kv, naive_attention

from pallas_kernels.kv_pool import KVPool
from pallas_kernels.paged_attention import paged_decode_attention
from zipage_jax.layers.xla_paged_attention import paged_attention, paged_decode_attention_reference

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

GROUP = 2
SCALE = 0.3  # not HEAD_DIM ** -0.5: the scale reaches the kernels


def windowed(q, k, v, length, window):
    """float64 attention of q [Hq, D] over the last `window` of k, v [:length] (all of them for 0)."""
    return naive_attention(q, k[max(0, length - window) if window else 0:length],
                           v[max(0, length - window) if window else 0:length], SCALE)


def decode_case(seed, lengths, width, block_size=16):
    rng = np.random.default_rng(seed)
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, block_size, width, lengths)
    q = rng.standard_normal((len(lengths), GROUP * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    return (jnp.asarray(q), k_pool, v_pool, tables, jnp.asarray(lengths, jnp.int32)), (q, ks, vs)


def expected_decode(ref, lengths, window):
    q, ks, vs = ref
    return np.stack([windowed(q[b].astype(np.float64), ks[b], vs[b], n, window) for b, n in enumerate(lengths)])


# padding row, shorter than the window, exactly the window, one block past it, several blocks past
LENGTHS = [0, 5, 24, 41, 100, 128]


@pytest.mark.parametrize("window", [1, 7, 24, 40])
@pytest.mark.parametrize("block_k, k_splits", [(16, 1), (16, 4), (32, 2), (64, 8)])
def test_pallas_decode_sees_only_the_window(window, block_k, k_splits):
    args, ref = decode_case(0, LENGTHS, width=8)
    out = paged_decode_attention(*args, scale=SCALE, window=window, interpret=True, block_k=block_k,
                                 k_splits=k_splits)
    np.testing.assert_allclose(np.asarray(out), expected_decode(ref, LENGTHS, window), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)  # padding row


@pytest.mark.parametrize("window", [1, 7, 24, 40])
def test_xla_decode_sees_only_the_window(window):
    args, ref = decode_case(1, LENGTHS, width=8)
    out = paged_decode_attention_reference(*args, scale=SCALE, window=window)
    np.testing.assert_allclose(np.asarray(out), expected_decode(ref, LENGTHS, window), atol=1e-5, rtol=1e-5)


def test_slots_below_the_window_may_hold_anything():
    """NaN keys and values below every window (a compacted sliding layer's stale slots) change nothing."""
    lengths, window = [0, 40, 100], 24
    args, ref = decode_case(5, lengths, width=8)
    q, k_pool, v_pool, tables, lens = args
    for b, n in enumerate(lengths):
        stale = np.arange(max(0, n - window))
        k_pool = k_pool.at[tables[b, stale // 16], stale % 16].set(np.nan)
        v_pool = v_pool.at[tables[b, stale // 16], stale % 16].set(np.nan)
    expected = expected_decode(ref, lengths, window)
    for out in (paged_decode_attention(q, k_pool, v_pool, tables, lens, scale=SCALE, window=window, interpret=True,
                                       block_k=16, k_splits=2),
                paged_decode_attention_reference(q, k_pool, v_pool, tables, lens, scale=SCALE, window=window)):
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)
    # positive control: without the window the stale slots are read
    assert np.isnan(np.asarray(paged_decode_attention_reference(q, k_pool, v_pool, tables, lens, scale=SCALE))).any()


def test_window_zero_or_past_every_length_is_full_attention():
    """Positive control both ways: no window (or one longer than every row) is full attention, and
    a window shorter than a row really changes that row's output."""
    args, ref = decode_case(2, LENGTHS, width=8)
    full = expected_decode(ref, LENGTHS, 0)
    for window in (0, 128):
        for out in (paged_decode_attention(*args, scale=SCALE, window=window, interpret=True, block_k=16, k_splits=4),
                    paged_decode_attention_reference(*args, scale=SCALE, window=window)):
            np.testing.assert_allclose(np.asarray(out), full, atol=1e-5, rtol=1e-5)
    cut = np.asarray(paged_decode_attention_reference(*args, scale=SCALE, window=24))
    assert np.abs(cut[3:] - full[3:]).max() > 1e-2  # rows longer than 24
    np.testing.assert_allclose(cut[:3], full[:3], atol=1e-5)  # rows within it


@pytest.mark.parametrize("window", [1, 9, 33])
@pytest.mark.parametrize("step_tokens", [16, 32, 128])
def test_xla_prefill_chunks_see_only_their_windows(window, step_tokens):
    """C tokens per row, each at its own kv_len (rows at different offsets, a padding token), over
    several loop steps: the loop starts at the batch's lowest visible slot."""
    rng = np.random.default_rng(3)
    lengths = [70, 40, 100]  # each row's K/V; its chunk's tokens sit at the end
    chunk = 12
    k_pool, v_pool, tables, ks, vs = make_paged_kv(rng, jnp.float32, 16, 8, lengths)
    kv_lens = np.asarray([[n - chunk + 1 + c for c in range(chunk)] for n in lengths], np.int32)
    kv_lens[1, -1] = 0  # a padding token
    q = rng.standard_normal((len(lengths), chunk, GROUP * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    out, _ = paged_attention(jnp.asarray(q), KVPool(k_pool, v_pool), tables, jnp.asarray(kv_lens), scale=SCALE,
                             step_tokens=step_tokens, window=window)
    for b in range(len(lengths)):
        for c in range(chunk):
            want = (windowed(q[b, c].astype(np.float64), ks[b], vs[b], kv_lens[b, c], window)
                    if kv_lens[b, c] else 0.0)
            np.testing.assert_allclose(np.asarray(out[b, c]), want, atol=1e-5, rtol=1e-5)


def test_negative_window_is_refused():
    args, _ = decode_case(4, [5], width=1)
    with pytest.raises(ValueError, match="window must be >= 0"):
        paged_decode_attention(*args, window=-1, interpret=True)
    with pytest.raises(ValueError, match="window must be >= 0"):
        paged_decode_attention_reference(*args, window=-1)


def test_windowed_kernel_lowers_for_triton():
    batch, width = 8, 16
    q = jax.ShapeDtypeStruct((batch, 8, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((1 + batch * width, 16, 4, 128), jnp.bfloat16)
    tables, lens = jax.ShapeDtypeStruct((batch, width), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    text = lower_for_h200(paged_decode_attention, q, pool, pool, tables, lens, window=100, block_k=32, k_splits=2)
    assert "__gpu$xla.gpu.triton" in text
