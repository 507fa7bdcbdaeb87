"""The fused q/k/v projection: qkv_proj's layout, its column shards, and loading into it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import hf_config

from zipage_jax.models.config import ModelConfig
from zipage_jax.models.weights import decoder_from_hf, flat_params, fuse_qkv, split_qkv

E, HQ, HKV, D = 8, 6, 2, 4


def _random(*shape: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("lead", [(E,), ()])  # a kernel [E, out] and a bias [out]
def test_split_qkv_inverts_fuse_qkv(lead):
    q, k, v = _random(*lead, HQ * D, seed=0), _random(*lead, HKV * D, seed=1), _random(*lead, HKV * D, seed=2)
    qkv = fuse_qkv(q, k, v, HKV)
    assert qkv.shape == (*lead, (HQ + 2 * HKV) * D)
    for got, want in zip(split_qkv(qkv, HQ, HKV), (q, k, v)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_column_shard_holds_whole_kv_heads_with_their_query_heads(shards):
    q, k, v = _random(E, HQ * D, seed=0), _random(E, HKV * D, seed=1), _random(E, HKV * D, seed=2)
    qkv = np.asarray(fuse_qkv(q, k, v, HKV))
    hq, hkv = HQ // shards, HKV // shards
    for s, shard in enumerate(np.split(qkv, shards, axis=-1)):
        q_s, k_s, v_s = split_qkv(shard, hq, hkv)
        np.testing.assert_array_equal(q_s, q[:, s * hq * D:(s + 1) * hq * D])
        np.testing.assert_array_equal(k_s, k[:, s * hkv * D:(s + 1) * hkv * D])
        np.testing.assert_array_equal(v_s, v[:, s * hkv * D:(s + 1) * hkv * D])


def _hf_tensors(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Random transformers-named tensors (torch Linear weights [out, in]) for cfg, with q/k/v biases."""
    E, Hq, Hkv, D, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, E), "model.norm.weight": (E,)}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (E,), f"{prefix}.post_attention_layernorm.weight": (E,),
            f"{prefix}.self_attn.q_proj.weight": (Hq * D, E), f"{prefix}.self_attn.q_proj.bias": (Hq * D,),
            f"{prefix}.self_attn.k_proj.weight": (Hkv * D, E), f"{prefix}.self_attn.k_proj.bias": (Hkv * D,),
            f"{prefix}.self_attn.v_proj.weight": (Hkv * D, E), f"{prefix}.self_attn.v_proj.bias": (Hkv * D,),
            f"{prefix}.self_attn.o_proj.weight": (E, Hq * D),
            f"{prefix}.mlp.gate_proj.weight": (I, E), f"{prefix}.mlp.up_proj.weight": (I, E),
            f"{prefix}.mlp.down_proj.weight": (E, I),
        }
    return {name: _random(*shape, seed=n) for n, (name, shape) in enumerate(shapes.items())}


def test_decoder_from_hf_fuses_every_layer():
    cfg = ModelConfig.from_hf(hf_config("qwen2", tie_word_embeddings=True))
    tensors = _hf_tensors(cfg)
    params = flat_params(decoder_from_hf(cfg, jnp.float32, tensors))
    assert {".".join(k.split(".")[2:-1]) for k in params if k.startswith("layers.")} == {
        "input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"}
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}"
        for leaf, hf_leaf, to_ours in (("kernel", "weight", np.transpose), ("bias", "bias", np.asarray)):
            want = [to_ours(tensors[f"{hf}.self_attn.{p}_proj.{hf_leaf}"]) for p in "qkv"]
            got = split_qkv(params[f"layers.{i}.self_attn.qkv_proj.{leaf}"], cfg.num_heads, cfg.num_kv_heads)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)


def test_a_checkpoint_missing_one_of_q_k_v_names_it():
    cfg = ModelConfig.from_hf(hf_config("qwen2", tie_word_embeddings=True))
    tensors = _hf_tensors(cfg)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 parameter\(s\): layers\.1\.self_attn\.v_proj\.kernel"):
        decoder_from_hf(cfg, jnp.float32, tensors)
