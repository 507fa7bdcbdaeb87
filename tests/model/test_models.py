"""ModelConfig, RoPE, RMSNorm, attention and the decoder, against transformers' PyTorch models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import hf_config

from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.layers.attention import causal_attention
from zipage_jax.layers.norms import rms_norm
from zipage_jax.layers.rotary import apply_rope, inv_frequencies, rope_cos_sin
from zipage_jax.models.config import ModelConfig, RopeScaling
from zipage_jax.models.decoder import Decoder, split, stages
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import split_qkv

torch = pytest.importorskip("torch")

PROMPT_IDS = [1, 42, 71, 78, 78, 81, 223, 89, 81, 84, 78, 70, 14, 300, 5, 2, 260]


# --- config -----------------------------------------------------------------------------------


def test_config_per_family():
    qwen3 = ModelConfig.from_hf(hf_config("qwen3"))
    assert (qwen3.architecture, qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == ("qwen3", 32, True, False)
    assert qwen3.tie_word_embeddings and qwen3.rope_theta == 1e6 and qwen3.rope_scaling is None
    qwen2 = ModelConfig.from_hf(hf_config("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.head_dim) == (True, False, False, 16)
    llama = ModelConfig.from_hf(hf_config("llama", attention_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.num_heads, llama.num_kv_heads) == (True, True, 4, 2)
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert (llama.bos_token_id, llama.eos_token_ids) == (1, (2,))
    hash(llama)  # a static jit argument


def test_config_from_v4_dict_and_eos_list():
    c = hf_config("llama").to_dict()
    del c["rope_parameters"]
    c.update(
        rope_theta=5e5,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        eos_token_id=[2, 7],
    )
    cfg = ModelConfig.from_hf(c)
    assert cfg.rope_theta == 5e5 and cfg.eos_token_ids == (2, 7)
    # original_max_position_embeddings falls back to max_position_embeddings, as in transformers
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 512)


def test_config_rejects_unsupported():
    import transformers

    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        ModelConfig.from_hf(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf(transformers.GPT2Config())
    with pytest.raises(ValueError, match="rope scaling type 'dynamic'"):
        ModelConfig.from_hf(hf_config("qwen3", rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf(hf_config("qwen2", num_key_value_heads=3))


# --- layers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_rope_matches_transformers(arch):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = hf_config(arch)
    cfg = ModelConfig.from_hf(config)
    ref_rope = LlamaRotaryEmbedding(config)
    inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(inv_freq, ref_rope.inv_freq.numpy(), rtol=1e-6)
    if arch == "llama":  # the scaling really changes the low frequencies
        assert not np.allclose(inv_freq, inv_frequencies(cfg.head_dim, cfg.rope_theta))

    rng = np.random.default_rng(0)
    positions = rng.integers(0, 500, size=(2, 5)).astype(np.int32)
    x = rng.standard_normal((2, 5, 3, cfg.head_dim)).astype(np.float32)
    cos, sin = ref_rope(torch.from_numpy(x), torch.from_numpy(positions).long())
    ref, _ = apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos, sin, unsqueeze_dim=2)
    ours = apply_rope(jnp.asarray(x), *rope_cos_sin(jnp.asarray(positions), inv_freq))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), atol=2e-5)


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 7, 16)).astype(np.float32) * 4
    w = rng.standard_normal(16).astype(np.float32)
    ref = LlamaRMSNorm(16, eps=1e-5)
    ref.weight.data = torch.from_numpy(w)
    np.testing.assert_allclose(
        np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5)), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-5
    )


def test_causal_attention_matches_repeated_kv_reference():
    rng = np.random.default_rng(2)
    B, T, Hq, Hkv, D = 2, 6, 4, 2, 8
    q, k, v = (rng.standard_normal((B, T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    cache = object()
    out, cache_out = causal_attention(3, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache)
    assert cache_out is cache

    kr, vr = np.repeat(k, Hq // Hkv, axis=2), np.repeat(v, Hq // Hkv, axis=2)  # q head h -> kv head h // 2
    scores = np.einsum("bthd,bshd->bhts", q, kr) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out), np.einsum("bhts,bshd->bthd", probs, vr), atol=1e-5)


# --- decoder ----------------------------------------------------------------------------------


def test_parity_with_transformers(tiny_model_dir, model_cache_dir):
    loaded = load_model(str(tiny_model_dir), dtype="float32", cache_dir=str(model_cache_dir))
    result = compare(model_logits(loaded.model, PROMPT_IDS), transformers_logits(str(tiny_model_dir), PROMPT_IDS))
    assert result["ok"], result
    assert result["max_abs_diff"] < 1e-4


def test_parity_llama_with_attention_bias(tiny_model_factory, model_cache_dir):
    path = tiny_model_factory("llama", attention_bias=True, tie_word_embeddings=True)
    loaded = load_model(str(path), dtype="float32", cache_dir=str(model_cache_dir))
    assert loaded.config.o_bias and loaded.config.tie_word_embeddings
    result = compare(model_logits(loaded.model, PROMPT_IDS), transformers_logits(str(path), PROMPT_IDS))
    assert result["ok"] and result["max_abs_diff"] < 1e-4, result


def _dense_cache_attention(layer, q, k, v, cache):
    """A KV-cache attn_fn: writes k, v at cache["positions"], attends to every slot at or before."""
    pos = cache["positions"]  # pos: [B, T]
    B, T, Hq, D = q.shape
    rows = jnp.arange(B)[:, None]
    K = cache["k"][layer].at[rows, pos].set(k)  # K: [B, S, Hkv, D]
    V = cache["v"][layer].at[rows, pos].set(v)
    Hkv, S = K.shape[2], K.shape[1]
    scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, T, Hkv, Hq // Hkv, D), K) * D**-0.5
    visible = jnp.arange(S)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), V).reshape(B, T, Hq, D)
    cache = {**cache, "k": [*cache["k"][:layer], K, *cache["k"][layer + 1 :]]}
    cache["v"] = [*cache["v"][:layer], V, *cache["v"][layer + 1 :]]
    return out, cache


def test_pure_forward_threads_cache_and_decodes_incrementally(tiny_model_factory, model_cache_dir):
    """Prefill then one decode step through a KV cache equals one full forward: the attn_fn gets
    post-RoPE keys at the given positions and the cache pytree comes back out of every layer."""
    loaded = load_model(str(tiny_model_factory("qwen3")), dtype="float32", cache_dir=str(model_cache_dir))
    cfg = loaded.config
    fns, state = split(loaded.model)
    step = jax.jit(fns.forward, static_argnames="attn_fn")
    ids = np.asarray([PROMPT_IDS, PROMPT_IDS[::-1]], np.int32)  # ids: [B, T]
    B, T = ids.shape
    full, _ = step(state, ids, np.tile(np.arange(T, dtype=np.int32), (B, 1)), attn_fn=causal_attention, cache=None)

    empty = jnp.zeros((B, 32, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    cache = {"k": [empty] * cfg.num_layers, "v": [empty] * cfg.num_layers}
    pos = np.tile(np.arange(T - 1, dtype=np.int32), (B, 1))
    _, cache = step(state, ids[:, :-1], pos, attn_fn=_dense_cache_attention, cache={**cache, "positions": pos})
    last = np.full((B, 1), T - 1, np.int32)
    hidden, cache = step(state, ids[:, -1:], last, attn_fn=_dense_cache_attention, cache={**cache, "positions": last})
    assert float(jnp.abs(cache["k"][1][:, T:]).max()) == 0.0 and float(jnp.abs(cache["k"][1][:, T - 1]).max()) > 0
    np.testing.assert_allclose(
        np.asarray(fns.logits(state, hidden[:, 0])), np.asarray(fns.logits(state, full[:, -1])), atol=1e-5
    )


def test_attn_fn_receives_normed_roped_q_k():
    """q/k reaching attn_fn are the projections after q/k-norm and RoPE at `positions`."""
    cfg = ModelConfig.from_hf(hf_config("qwen3"))
    model = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    seen = {}

    def record(layer, q, k, v, cache):
        seen.setdefault(layer, (q, k, v))
        return jnp.zeros_like(q), cache + 1

    ids = jnp.asarray([[5, 6, 7]], jnp.int32)
    positions = jnp.asarray([[10, 11, 20]], jnp.int32)
    hidden, count = model(ids, positions, record, 0)
    assert count == cfg.num_layers and sorted(seen) == list(range(cfg.num_layers))
    assert hidden.shape == (1, 3, cfg.hidden_size)

    attn = model.layers[0].self_attn
    x = model.layers[0].input_layernorm(model.embed_tokens(ids))
    q, k, v = split_qkv(attn.qkv_proj(x), cfg.num_heads, cfg.num_kv_heads)
    q = rms_norm(q.reshape(1, 3, cfg.num_heads, cfg.head_dim), attn.q_norm.weight[...], cfg.rms_norm_eps)
    k = rms_norm(k.reshape(1, 3, cfg.num_kv_heads, cfg.head_dim), attn.k_norm.weight[...], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, inv_frequencies(cfg.head_dim, cfg.rope_theta))
    np.testing.assert_allclose(np.asarray(seen[0][0]), np.asarray(apply_rope(q, cos, sin)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(seen[0][1]), np.asarray(apply_rope(k, cos, sin)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(seen[0][2]), np.asarray(v.reshape(1, 3, cfg.num_kv_heads, cfg.head_dim)),
                               atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_is_the_lm_head_only(tied):
    cfg = ModelConfig.from_hf(hf_config("qwen2", tie_word_embeddings=tied))
    model = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    hidden = jax.random.normal(jax.random.key(2), (3, cfg.hidden_size))
    head = model.embed_tokens if tied else model.lm_head
    assert (model.lm_head is None) == tied
    logits = model.logits(hidden)
    assert logits.dtype == jnp.float32 and logits.shape == (3, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(hidden @ head.weight[...].T), rtol=1e-5, atol=1e-6)


def test_bfloat16_model_keeps_weights_in_dtype(tiny_model_factory, model_cache_dir):
    path = tiny_model_factory("llama")
    f32 = load_model(str(path), dtype="float32", cache_dir=str(model_cache_dir))
    bf16 = load_model(str(path), dtype="bfloat16", cache_dir=str(model_cache_dir))
    dtypes = {x.dtype for x in jax.tree.leaves(split(bf16.model)[1])}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    ours, ref = model_logits(bf16.model, PROMPT_IDS), model_logits(f32.model, PROMPT_IDS)
    assert ours.dtype == np.float32
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("per_group", [1, 2, 4])
def test_stages_compose_to_the_whole_forward(tied, per_group):
    """embed, every group of layers (each numbering its layers from 0 in its own cache), then
    norm and LM head give the whole forward's logits and the same cache values per layer."""
    cfg = dataclasses.replace(ModelConfig.from_hf(hf_config("qwen3")), num_layers=4, tie_word_embeddings=tied)
    model = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    fns, state = split(model)
    ids = jnp.asarray([[5, 6, 7, 9]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]

    def record(layer, q, k, v, cache):  # cache: the keys each layer saw, by its index
        return causal_attention(layer, q, k, v, None)[0], cache[:layer] + (k,) + cache[layer + 1:]

    hidden, keys = fns.forward(state, ids, pos, record, (None,) * 4)
    staged, params = stages(model, per_group)
    assert len(params.groups) == 4 // per_group and all(len(g) == per_group for g in params.groups)
    x, seen = staged.embed(params.embed, ids), []
    for group in params.groups:
        x, group_keys = staged.layers(group, x, pos, record, (None,) * per_group)
        seen += group_keys
    np.testing.assert_allclose(np.asarray(staged.logits(params.head, staged.norm(params.head, x))),
                               np.asarray(fns.logits(state, hidden)), rtol=1e-5, atol=1e-5)
    for got, want in zip(seen, keys):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="do not divide"):
        stages(model, 3)
