"""Mixtures of experts (Qwen3-MoE, Mixtral): the grouped expert MLP against its dense reference,
the config's MoE fields and refusals, logits against transformers, greedy tokens through the
engine (full KV and compressed), tensor parallelism, and no compiles once warmed up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import MOE_ARCHS, hf_config

from zipage_jax import LLM, SamplingParams
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.crosscheck.reference import load_reference_model, reference_greedy
from zipage_jax.layers.moe import grouped_mlp, grouped_mlp_reference, route
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.loading import load_model

torch = pytest.importorskip("torch")

PROMPT_IDS = [1, 42, 71, 78, 78, 81, 223, 89, 81, 84, 78, 70, 14, 300, 5, 2, 260]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37]
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=256, dtype="float32")


# --- the grouped expert MLP -------------------------------------------------------------------


def _experts(seed: int, E: int = 5, H: int = 16, I: int = 24):  # noqa: E741
    keys = jax.random.split(jax.random.key(seed), 3)
    return (0.3 * jax.random.normal(keys[0], (E, H, I)), 0.3 * jax.random.normal(keys[1], (E, H, I)),
            0.3 * jax.random.normal(keys[2], (E, I, H)))


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "ragged_dot"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [13, 100])  # a multiple of neither k nor the expert count; several tiles each
def test_grouped_mlp_equals_dense_reference(tiled, k, renormalize, tokens):
    E = 5
    experts_w = _experts(0, E)
    x = jax.random.normal(jax.random.key(1), (tokens, 16))
    weights, experts = route(jax.random.normal(jax.random.key(2), (tokens, E)) * 3, k, renormalize)
    assert experts.shape == (tokens, k) and len(np.unique(np.asarray(experts))) > 1  # routing really spreads
    grouped = jax.jit(grouped_mlp, static_argnames="tiled")
    ours = grouped(x, weights, experts, *experts_w, tiled=tiled)
    ref = grouped_mlp_reference(x, weights, experts, *experts_w)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # every row to one expert, the others empty
    lopsided = jnp.zeros_like(experts).at[:, 1:].set(3)
    np.testing.assert_allclose(np.asarray(grouped(x, weights, lopsided, *experts_w, tiled=tiled)),
                               np.asarray(grouped_mlp_reference(x, weights, lopsided, *experts_w)), rtol=1e-5,
                               atol=1e-5)
    # positive control: another routing gives another output
    other = grouped(x, weights, (experts + 1) % E, *experts_w, tiled=tiled)
    assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-2


def test_route_takes_the_top_k_of_a_float32_softmax():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.9]], jnp.bfloat16)
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
    weights, experts = route(logits, 2, renormalize=False)
    assert weights.dtype == jnp.float32 and experts.tolist() == [[1, 2], [0, 3]]
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(experts), 1), rtol=1e-6)
    renormed, _ = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(np.asarray(renormed).sum(-1), 1.0, rtol=1e-6)
    assert np.asarray(weights).sum(-1).max() < 0.99  # positive control: not renormalised


# --- config -----------------------------------------------------------------------------------


def test_config_reads_the_expert_fields():
    qwen = ModelConfig.from_hf(hf_config("qwen3_moe"))
    assert (qwen.architecture, qwen.num_experts, qwen.num_experts_per_tok, qwen.mlp_width) == ("qwen3_moe", 8, 2, 32)
    assert qwen.qk_norm and not qwen.norm_topk_prob
    mixtral = ModelConfig.from_hf(hf_config("mixtral"))
    assert (mixtral.architecture, mixtral.num_experts, mixtral.num_experts_per_tok) == ("mixtral", 4, 2)
    assert mixtral.mlp_width == 48 and mixtral.norm_topk_prob and not mixtral.qk_norm
    hub_style = {**hf_config("qwen3_moe").to_dict(), "num_experts": 6}  # the Hub's configs name it num_experts
    del hub_style["num_local_experts"]
    assert ModelConfig.from_hf(hub_style).num_experts == 6
    assert ModelConfig.from_hf(hf_config("qwen3", num_experts=4)).num_experts == 0  # dense families ignore it


@pytest.mark.parametrize(("arch", "overrides", "field"), [
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window"),
    ("mixtral", dict(sliding_window=128), "sliding_window"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_config_refuses_unsupported_moe_fields(arch, overrides, field):
    with pytest.raises(ValueError, match=f"{field}"):
        ModelConfig.from_hf(hf_config(arch, **overrides))


def test_config_accepts_a_window_that_masks_nothing():
    """Positive control of the refusals: a window as long as the model's context changes no mask."""
    assert ModelConfig.from_hf(hf_config("mixtral", sliding_window=512)).num_experts == 4
    assert ModelConfig.from_hf(hf_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=1)).num_experts == 8


# --- the model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_cache(model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield model_cache_dir
    mp.undo()


@pytest.mark.parametrize(("arch", "overrides"), [("qwen3_moe", {}), ("qwen3_moe", dict(norm_topk_prob=True)),
                                                  ("mixtral", {})])
def test_logits_match_transformers(arch, overrides, tiny_model_factory, moe_cache):
    path = tiny_model_factory(arch, **overrides)
    ref = transformers_logits(str(path), PROMPT_IDS)
    for _ in range(2):  # converted, then restored from the parameter cache
        loaded = load_model(str(path), dtype="float32", cache_dir=str(moe_cache))
        result = compare(model_logits(loaded.model, PROMPT_IDS), ref)
        assert result["ok"] and result["max_abs_diff"] < 1e-4, result
    assert loaded.from_cache and loaded.config.norm_topk_prob == overrides.get("norm_topk_prob", arch == "mixtral")


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_greedy_matches_transformers_and_compresses(arch, tiny_model_factory, moe_cache):
    path = str(tiny_model_factory(arch))
    llm = LLM(path, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [r["token_ids"] for r in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    model = load_reference_model(path)
    assert ours == [reference_greedy(model, prompt, 12) for prompt in PROMPTS]

    budget = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_budget=32)
    before = llm.engine.stats.num_compressions
    compressed = llm.generate(PROMPTS, budget, use_tqdm=False)
    assert llm.engine.stats.num_compressions > before
    assert all(len(r["token_ids"]) == 60 and r["metrics"]["kv_blocks_peak"] <= 3 for r in compressed)


# --- tensor parallelism and steady state (slow: engines in other Pythons, a warm-up) -------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tensor_parallel_gives_the_same_greedy_tokens(arch, tiny_model_factory, moe_cache):
    from engine.test_tensor_parallel import assert_two_all_reduces_per_layer, run_worker

    report = run_worker(tiny_model_factory(arch), 2, moe_cache, "--max-tokens", "40", "--num-prompts", "2")
    assert report["full_identical"] and report["compressed_identical"], report["tokens"]
    assert report["compressions_tp1"] > 0 and report["compressions_tp2"] > 0
    experts = {name: s for name, s in report["shardings"].items() if ".mlp.experts." in name}
    assert experts and all(s["shard_shape"] != s["shape"] for s in experts.values())  # split, not replicated
    assert report["compiles_in_steady_state"] == 0
    assert_two_all_reduces_per_layer(report)  # after o_proj and after the experts' down_proj: nothing gathered


@pytest.mark.slow
def test_warmed_up_moe_engine_never_compiles(tiny_model_factory, moe_cache):
    from engine.test_steady_state import OPTIONS, count_compiles, mixed_workload

    warm = LLM(str(tiny_model_factory("qwen3_moe")), warmup=True, **OPTIONS)
    built = warm.engine.core.runner.num_compiles
    logged, _ = count_compiles(lambda: mixed_workload(warm))
    assert logged == 0 and warm.engine.core.runner.num_compiles == built > 0
