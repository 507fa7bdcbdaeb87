"""gpt-oss: its config fields and refusals, YaRN RoPE against transformers, the biased experts with
their clamped SwiGLU against transformers' expert module, logits against transformers on prompts
longer than the sliding window; as slow tests, greedy tokens through the engine (XLA and the
Pallas decode kernel in interpret mode), a KV budget and a warmed-up engine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import hf_config

from zipage_jax import LLM, SamplingParams
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.crosscheck.reference import load_reference_model, reference_greedy
from zipage_jax.layers.moe import ClampedSwiGLU, ExpertBiases, grouped_mlp, grouped_mlp_reference, route
from zipage_jax.layers.rotary import inv_frequencies
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import decoder_from_flat, flat_params

torch = pytest.importorskip("torch")

WINDOW = 8  # the tiny model's sliding window (tests/tiny_models.py)
PROMPT_IDS = [1, 42, 71, 78, 78, 81, 223, 89, 81, 84, 78, 70, 14, 300, 5, 2, 260, 9, 17, 33, 64, 101, 7]  # 23 > 8
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7, 9] * 20]
# prefill in chunks of 16 tokens, so a chunk's queries reach back into the previous chunk's window
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=256, dtype="float32", compilation_cache_dir="")


@pytest.fixture(scope="module")
def gpt_oss_cache(model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield model_cache_dir
    mp.undo()


# --- config -----------------------------------------------------------------------------------


def test_config_reads_the_gpt_oss_fields():
    cfg = ModelConfig.from_hf(hf_config("gpt_oss"))
    assert cfg.architecture == "gpt_oss" and cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.layer_windows == (8, 0, 8, 0) and not cfg.gemma and not cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_width, cfg.norm_topk_prob) == (4, 2, 32, True)
    assert cfg.expert_bias and cfg.expert_glu == ClampedSwiGLU(limit=1.0, alpha=1.702)
    yarn = cfg.rope_scaling
    assert (yarn.rope_type, yarn.factor, yarn.original_max_position_embeddings, yarn.truncate) == ("yarn", 32.0, 16,
                                                                                                   False)
    assert yarn.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1.0)
    # transformers' defaults: every other layer sliding from the first, 128-token windows, YaRN x32
    c = {**hf_config("gpt_oss").to_dict(), "num_hidden_layers": 6}
    del c["layer_types"]
    assert ModelConfig.from_hf(c).layer_windows == (8, 0) * 3
    released = ModelConfig.from_hf(_released_config())
    assert released.layer_windows == (128, 0) * 12 and released.rope_scaling.factor == 32.0
    dense = ModelConfig.from_hf(hf_config("llama"))
    assert not (dense.attention_sinks or dense.expert_bias) and dense.expert_glu is None


def _released_config() -> dict:
    import transformers

    return transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32).to_dict()


def test_config_refuses_mxfp4_weights():
    c = {**_released_config(), "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}}
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        ModelConfig.from_hf(c)
    ModelConfig.from_hf({**c, "quantization_config": None})  # positive control: the same config unquantized


def test_gpt_oss_gguf_is_refused(tmp_path):
    import gguf

    from zipage_jax.models.gguf import hf_config as gguf_config
    from zipage_jax.models.gguf import open_gguf

    def header_only(arch: str):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return open_gguf(path)

    with pytest.raises(ValueError, match="unsupported architecture 'gpt-oss' in GGUF file"):
        gguf_config(header_only("gpt-oss"))
    with pytest.raises(Exception) as llama:  # positive control: llama passes the architecture check
        gguf_config(header_only("llama"))
    assert "unsupported architecture" not in str(llama.value)


# --- YaRN and the experts against transformers ---------------------------------------------------


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=16),
    dict(factor=4.0, original_max_position_embeddings=64),  # truncate (default True), default betas
    dict(factor=8.0, original_max_position_embeddings=32, mscale=2.0, mscale_all_dim=1.0),
    dict(factor=8.0, original_max_position_embeddings=32, attention_factor=0.7),
])
def test_yarn_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config("gpt_oss", rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, **params})
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_hf(hf)
    ours = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(ours, ref_inv_freq.numpy(), rtol=1e-6)
    assert cfg.rope_scaling.attention_factor == pytest.approx(ref_factor, rel=1e-12)
    plain = inv_frequencies(cfg.head_dim, cfg.rope_theta)
    assert (ours < plain * 0.99).any() and (ours == plain).any()  # positive control: some scaled, some kept


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "ragged_dot"])
def test_experts_match_transformers_expert_module(tiled):
    """Our grouped experts (gate_up de-interleaved as weights.py loads it) against transformers'
    GptOssExperts with the same weights, biases and routing; and against the dense reference."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = hf_config("gpt_oss", hidden_size=16, intermediate_size=24, num_local_experts=5, swiglu_limit=0.8)
    module = GptOssExperts(hf)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    x = torch.randn(37, 16, generator=gen)
    weights, experts = route(jax.random.normal(jax.random.key(2), (37, 5)) * 3, 2, renormalize=True)
    ref = module(x, torch.tensor(np.asarray(experts)).long(), torch.tensor(np.asarray(weights))).detach()
    gate_up, gate_up_bias = module.gate_up_proj.detach().numpy(), module.gate_up_proj_bias.detach().numpy()
    kernels = tuple(jnp.asarray(w) for w in (gate_up[..., ::2], gate_up[..., 1::2], module.down_proj.detach().numpy()))
    biases = ExpertBiases(*(jnp.asarray(b) for b in (gate_up_bias[..., ::2], gate_up_bias[..., 1::2],
                                                     module.down_proj_bias.detach().numpy())))
    glu, x = ClampedSwiGLU(limit=0.8), jnp.asarray(x.numpy())
    grouped = jax.jit(grouped_mlp, static_argnames=("tiled", "glu"))
    ours = grouped(x, weights, experts, *kernels, tiled=tiled, biases=biases, glu=glu)
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-5, atol=1e-5)
    dense = grouped_mlp_reference(x, weights, experts, *kernels, biases=biases, glu=glu)
    np.testing.assert_allclose(np.asarray(dense), ref.numpy(), rtol=1e-5, atol=1e-5)
    # positive controls: the clamp and the biases matter
    unclamped = grouped(x, weights, experts, *kernels, tiled=tiled, biases=biases, glu=ClampedSwiGLU(1e9))
    unbiased = grouped(x, weights, experts, *kernels, tiled=tiled, glu=glu)
    for other in (unclamped, unbiased):
        assert np.abs(np.asarray(other) - ref.numpy()).max() > 1e-2


# --- against transformers ----------------------------------------------------------------------


def test_logits_match_transformers(tiny_model_factory, gpt_oss_cache):
    path = tiny_model_factory("gpt_oss")
    ref = transformers_logits(str(path), PROMPT_IDS)
    loaded = load_model(str(path), dtype="float32", cache_dir=str(gpt_oss_cache))
    result = compare(model_logits(loaded.model, PROMPT_IDS), ref)
    assert result["ok"] and result["max_abs_diff"] < 1e-4, result
    flat = flat_params(loaded.model)
    # positive controls: sinks of -inf (none) change every position; windows past the prompt only those past 8
    no_sinks = decoder_from_flat(loaded.config, jnp.float32, {
        k: jnp.full_like(v, -jnp.inf) if k.endswith("sinks") else v for k, v in flat.items()})
    assert np.abs(model_logits(no_sinks, PROMPT_IDS) - ref).max(axis=-1).min() > 1e-3
    wide = tuple(512 if w else 0 for w in loaded.config.layer_windows)
    unwindowed = decoder_from_flat(dataclasses.replace(loaded.config, layer_windows=wide), jnp.float32, flat)
    diff = np.abs(model_logits(unwindowed, PROMPT_IDS) - ref).max(axis=-1)
    assert diff[:WINDOW].max() < 1e-4 and diff[WINDOW:].max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_engine_greedy_matches_transformers(backend, tiny_model_factory, gpt_oss_cache):
    from runner_backend import use_backend

    path = str(tiny_model_factory("gpt_oss"))
    llm = LLM(path, **ENGINE)
    use_backend(llm.engine.core.runner, backend)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [r["token_ids"] for r in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    model = load_reference_model(path)
    assert ours == [reference_greedy(model, prompt, 12) for prompt in PROMPTS]


@pytest.mark.slow
def test_engine_runs_under_a_kv_budget(tiny_model_factory, gpt_oss_cache):
    """A 32-token budget (>= the window): sequences compress and run to their length."""
    llm = LLM(str(tiny_model_factory("gpt_oss")), **ENGINE)
    budget = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_budget=32)
    compressed = llm.generate(PROMPTS, budget, use_tqdm=False)
    assert llm.engine.stats.num_compressions > 0
    assert all(len(r["token_ids"]) == 60 and r["metrics"]["kv_blocks_peak"] <= 3 for r in compressed)


@pytest.mark.slow
def test_warmed_up_gpt_oss_engine_never_compiles(tiny_model_factory, gpt_oss_cache):
    from engine.test_steady_state import OPTIONS, count_compiles, mixed_workload

    warm = LLM(str(tiny_model_factory("gpt_oss")), warmup=True, **OPTIONS)
    built = warm.engine.core.runner.num_compiles
    logged, _ = count_compiles(lambda: mixed_workload(warm))
    assert logged == 0 and warm.engine.core.runner.num_compiles == built > 0
    assert warm.engine.get_stats().num_compressions > 0
