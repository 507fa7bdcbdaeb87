"""`zipage-jax eval int4-keys`: its quantizers and attention on tiny synthetic inputs, and its
capture of a model's queries, keys and values (a random two-layer model)."""

import numpy as np
import pytest

from zipage_jax.evals import int4_keys as ek

T, H, D = 64, 2, 64  # two groups of 32 tokens, two groups of 32 elements


def _keys(seed=0, outlier=None):
    x = np.random.default_rng(seed).standard_normal((T, H, D)).astype(np.float32)
    if outlier is not None:  # one channel far larger than the rest in every token (keys' outlier channels)
        x[:, :, outlier] += 20.0
    return x


def _bound(x, axis, qmax):
    """Half a quantization step of the slices along `axis`, with float16's rounding of the scale."""
    return np.abs(x).max(axis=axis, keepdims=True) / qmax / 2 * (1 + 2**-10) + 1e-7


def test_int8_per_token_round_trips_within_half_a_step():
    x = _keys()
    err = np.abs(ek.int8_per_token(x) - x)
    assert np.all(err <= _bound(x, -1, 127))
    assert err.max() > 0


def test_int4_per_token_round_trips_within_half_a_step_of_each_group_of_32_elements():
    x = _keys()
    x[3, 1, :32] *= 100  # a large first group must not coarsen the second one
    err = np.abs(ek.int4_per_token(x) - x).reshape(T, H, D // 32, 32)
    assert np.all(err <= _bound(x.reshape(T, H, D // 32, 32), -1, 7))
    assert err[3, 1, 1].max() <= _bound(x[3, 1, 32:], -1, 7).max()


def test_int4_per_channel_round_trips_within_half_a_step_of_each_channel_over_32_tokens():
    x = _keys()
    x[0, 0, 5] = 50.0  # one large value coarsens its channel in its 32 tokens only
    err = np.abs(ek.int4_per_channel(x) - x).reshape(T // 32, 32, H, D)
    assert np.all(err <= _bound(x.reshape(T // 32, 32, H, D), 1, 7))
    assert np.abs(ek.int4_per_channel(x)[32:, 0, 5] - x[32:, 0, 5]).max() <= _bound(x[32:, 0, 5], 0, 7).max()


def test_int4_per_channel_gives_a_last_partial_group_of_tokens_its_own_scales():
    x = _keys()[:40]
    x[:32, 0, 0] *= 1000  # would swamp the 8 tail tokens if they shared the first group's scale
    err = np.abs(ek.int4_per_channel(x)[32:, 0, 0] - x[32:, 0, 0])
    assert err.max() <= _bound(x[32:, 0, 0], 0, 7).max()


def test_quantizers_keep_zeros_exact_and_values_within_levels():
    x = _keys()
    x[7] = 0.0
    for layout in ek.LAYOUTS:
        k, v = ek.quantize(layout, x, x)
        assert k.shape == v.shape == x.shape and np.all(np.isfinite(k))
        assert np.all(k[7] == 0) and np.all(v[7] == 0)
    step = np.abs(x[:, :, :32]).max(-1, keepdims=True).astype(np.float32) / 7
    levels = ek.int4_per_token(x)[:, :, :32] / step.astype(np.float16).astype(np.float32).clip(2**-14)
    assert np.allclose(levels, np.rint(levels), atol=1e-3) and np.abs(levels).max() <= 7 + 1e-3


def test_a_key_with_an_outlier_channel_is_reconstructed_better_per_channel():
    k = _keys(outlier=11)
    per_token, per_channel = ek.rel_err(ek.int4_per_token(k), k), ek.rel_err(ek.int4_per_channel(k), k)
    assert per_channel < 0.5 * per_token
    # without outliers neither layout wins by much
    k = _keys()
    assert 0.5 < ek.rel_err(ek.int4_per_channel(k), k) / ek.rel_err(ek.int4_per_token(k), k) < 2


def test_layer_errors_rank_the_layouts_on_outlier_keys_and_leave_values_alike():
    k, v = _keys(outlier=11), _keys(seed=1)
    q = np.random.default_rng(2).standard_normal((4, 2 * H, D)).astype(np.float32)
    q[:, :, 11] *= 0.1  # attention leans on the outlier channel, not only on it
    errs = ek.layer_errors(q, k, v)
    assert set(errs) == set(ek.LAYOUTS)
    assert errs["int4-channel"]["key_err"] < errs["int4-token"]["key_err"]
    assert errs["int4-channel"]["attn_err_k"] < errs["int4-token"]["attn_err_k"]
    assert errs["int4-channel"]["value_err"] == errs["int4-token"]["value_err"]  # same value layout
    assert errs["int8-token"]["attn_err"] < errs["int4-channel"]["attn_err"]
    assert all(0 < e["attn_err_k"] <= e["attn_err"] * 1.5 for e in errs.values())


def test_attention_is_causal_over_the_last_queries_and_maps_query_heads_to_kv_heads():
    rng = np.random.default_rng(3)
    Q, Hq = 3, 4
    q, k, v = rng.standard_normal((Q, Hq, D)), rng.standard_normal((T, H, D)), rng.standard_normal((T, H, D))
    out = ek.attention(q, k, v)
    for i in range(Q):
        for h in range(Hq):
            n = T - Q + i + 1  # query i sits at position T - Q + i
            s = k[:n, h // (Hq // H)] @ q[i, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[i, h], (p / p.sum()) @ v[:n, h // (Hq // H)], rtol=1e-10)


def test_equal_scale_bytes_for_the_two_int4_layouts():
    assert ek.key_bytes("int4-token", 64) == ek.key_bytes("int4-channel", 64) == 32 + 4
    assert ek.key_bytes("int8-token", 64) == 68
    with pytest.raises(ValueError):
        ek.quantize("int4-nope", _keys(), _keys())


def test_summary_means_over_texts_then_layers():
    def layer(a):
        return {lo: {m: a for m in ek.METRICS} for lo in ek.LAYOUTS} | {"model_check": 1e-7}

    rows, summary = ek.summarize({"a": [layer(0.1), layer(0.3)], "b": [layer(0.3), layer(0.5)]}, head_dim=64)
    assert len(rows) == 2 * len(ek.LAYOUTS)
    assert [r["attn_err"] for r in rows if r["layout"] == "int4-token"] == pytest.approx([0.2, 0.4])
    s = {x["layout"]: x for x in summary}
    assert s["int4-channel"]["attn_err"] == pytest.approx(0.3)
    assert s["int4-channel"]["max_attn_err"] == pytest.approx(0.4)
    text = ek.markdown(rows, summary, {"model": "m", "texts": ["a", "b"], "length": 8, "queries": 2})
    assert "| int4-channel | 36 | 0.3000 |" in text and "| mean |" in text


def test_hadamard_rotation_is_orthonormal_and_spreads_an_outlier_channel():
    h = ek.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 2, 64)).astype(np.float32)
    x[..., 5] *= 40.0  # one outlier channel: per-token scales waste their range on it
    assert ek.rel_err(ek.int4_hadamard(x), x) < 0.5 * ek.rel_err(ek.int4_per_token(x), x)


def test_capture_hands_every_layer_and_matches_the_models_own_attention():
    from zipage_jax.models.loading import load_model

    loaded = load_model("random-qwen3-tiny")
    cfg = loaded.config
    layers = ek.capture(loaded, list(range(1, 41)), num_queries=16)
    assert len(layers) == cfg.num_layers
    for q, k, v, model_out in layers:
        assert q.shape == model_out.shape == (16, cfg.num_heads, cfg.head_dim)
        assert k.shape == v.shape == (40, cfg.num_kv_heads, cfg.head_dim)
        assert ek.rel_err(ek.attention(q, k, v), model_out) < 1e-5
        assert ek.rel_err(ek.attention(q, k[::-1], v), model_out) > 1e-2  # control: the check sees a wrong key order
