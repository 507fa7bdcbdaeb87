"""Gemma 3 (text): its config fields and refusals, sliding-window dense attention, layer groups that
repeat the layer pattern, logits against transformers on prompts longer than the window, and
greedy tokens through the engine (XLA and the Pallas decode kernel in interpret mode)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import hf_config

from zipage_jax import LLM, SamplingParams
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.crosscheck.reference import load_reference_model, reference_greedy
from zipage_jax.engine.runner.forward import layers_per_group
from zipage_jax.layers.attention import causal_attention
from zipage_jax.layers.rotary import RopeScaling
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.decoder import Decoder, split, stages
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import decoder_from_flat, flat_params

torch = pytest.importorskip("torch")

WINDOW = 8  # the tiny model's sliding window (tests/tiny_models.py)
PROMPT_IDS = [1, 42, 71, 78, 78, 81, 223, 89, 81, 84, 78, 70, 14, 300, 5, 2, 260, 9, 17, 33, 64, 101, 7]  # 23 > 8
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7, 9] * 20]
# prefill in chunks of 16 tokens, so a chunk's queries reach back into the previous chunk's window
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=256, dtype="float32", compilation_cache_dir="")
# the tiny model's 5 layers (windows 8, 8, full, 8, 8: the pattern of 3 does not divide them, one group
# in the engine), and 9 layers (the pattern three times: three groups of 3)
DEPTHS = {"5 layers": {}, "9 layers": dict(num_hidden_layers=9)}


@pytest.fixture(scope="module")
def gemma_cache(model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield model_cache_dir
    mp.undo()


# --- config -----------------------------------------------------------------------------------


def test_config_reads_the_gemma3_fields():
    cfg = ModelConfig.from_hf(hf_config("gemma3"))
    assert cfg.architecture == "gemma3_text" and cfg.gemma and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.layer_windows == (8, 8, 0, 8, 8) and [cfg.window(i) for i in range(5)] == [8, 8, 0, 8, 8]
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.sliding_rope_theta) == (1e6, RopeScaling("linear", 4.0), 1e4)
    assert cfg.attention_scale == pytest.approx(24**-0.5) and cfg.final_logit_softcapping == 4.0
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    # the Hub's older config.json: rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern
    v4 = {k: v for k, v in hf_config("gemma3").to_dict().items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
              sliding_window_pattern=3)
    assert ModelConfig.from_hf(v4) == cfg
    default_pattern = ModelConfig.from_hf({**v4, "num_hidden_layers": 12, "sliding_window_pattern": None})
    assert default_pattern.layer_windows == (8,) * 5 + (0,) + (8,) * 5 + (0,)  # every 6th layer is full
    dense = ModelConfig.from_hf(hf_config("llama"))
    assert not dense.gemma and dense.layer_windows == () and dense.window(0) == 0 and dense.hidden_act == "silu"


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(sliding_window=None), "sliding_window must be a positive"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] + ["full_attention"] * 3), "layer_types"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "sliding-window layers"),
])
def test_config_refuses_what_it_does_not_implement(overrides, message):
    c = {**hf_config("gemma3").to_dict(), **overrides}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(c)


# --- attention and layer groups ----------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 6])
def test_causal_attention_window_matches_numpy(window):
    rng = np.random.default_rng(0)
    B, T, Hq, Hkv, D = 2, 9, 4, 2, 8
    q, k, v = (rng.standard_normal((B, T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    out, _ = causal_attention(0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, window=window, scale=0.2)
    kr, vr = np.repeat(k, Hq // Hkv, axis=2), np.repeat(v, Hq // Hkv, axis=2)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    scores = np.where((s <= t) & (s > t - window), np.einsum("bthd,bshd->bhts", q, kr) * 0.2, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out), np.einsum("bhts,bshd->bthd", probs / probs.sum(-1, keepdims=True), vr),
                               atol=1e-5)
    full, _ = causal_attention(0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, scale=0.2)
    assert np.abs(np.asarray(full)[:, window:] - np.asarray(out)[:, window:]).max() > 1e-2  # positive control


@pytest.mark.parametrize(("depth", "windows", "size"), [
    (5, (8, 8, 0, 8, 8), 5),  # no smaller group repeats the pattern: one group
    (9, (8, 0, 8) * 3, 3),
    (26, ((512,) * 5 + (0,)) * 4 + (512, 512), 26),  # Gemma 3 1B
    (48, ((1024,) * 5 + (0,)) * 8, 6),  # Gemma 3 12B
    (16, (), 8),  # no windows: as before
])
def test_layer_groups_repeat_the_layer_pattern(depth, windows, size):
    assert layers_per_group(depth, windows) == size


def test_stages_compose_and_refuse_groups_off_the_pattern():
    """Groups of 3 layers (windows 8, 8, full) compose to the whole forward; groups of 2 would give the
    second group's first layer (full) the first group's window, so stages() refuses them."""
    cfg = ModelConfig.from_hf(hf_config("gemma3", num_hidden_layers=6))
    model = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    fns, state = split(model)
    ids = jnp.asarray([PROMPT_IDS], jnp.int32)
    pos = jnp.arange(len(PROMPT_IDS), dtype=jnp.int32)[None]
    hidden, _ = fns.forward(state, ids, pos, causal_attention, None)
    staged, params = stages(model, 3)
    x = staged.embed(params.embed, ids)
    for group in params.groups:
        x, _ = staged.layers(group, x, pos, causal_attention, None)
    np.testing.assert_allclose(np.asarray(staged.logits(params.head, staged.norm(params.head, x))),
                               np.asarray(fns.logits(state, hidden)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not repeat the model's layer pattern"):
        stages(model, 2)


# --- against transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", list(DEPTHS))
def test_logits_match_transformers(depth, tiny_model_factory, gemma_cache):
    path = tiny_model_factory("gemma3", **DEPTHS[depth])
    ref = transformers_logits(str(path), PROMPT_IDS)
    loaded = load_model(str(path), dtype="float32", cache_dir=str(gemma_cache))
    result = compare(model_logits(loaded.model, PROMPT_IDS), ref)
    assert result["ok"] and result["max_abs_diff"] < 1e-4, result
    assert np.abs(ref).max() < 4.0  # the soft cap holds
    # positive control: the same model with windows past the prompt differs past the window only
    wide = tuple(512 if w else 0 for w in loaded.config.layer_windows)
    unwindowed = decoder_from_flat(dataclasses.replace(loaded.config, layer_windows=wide), jnp.float32,
                                   flat_params(loaded.model))
    diff = np.abs(model_logits(unwindowed, PROMPT_IDS) - ref).max(axis=-1)
    assert diff[:WINDOW].max() < 1e-4 and diff[WINDOW:].max() > 1e-2


@pytest.mark.parametrize(("depth", "backend"), [
    pytest.param("5 layers", "xla", marks=pytest.mark.slow), pytest.param("9 layers", "xla", marks=pytest.mark.slow),
    pytest.param("9 layers", "pallas-interpret", marks=pytest.mark.slow)])
def test_engine_greedy_matches_transformers(depth, backend, tiny_model_factory, gemma_cache):
    from runner_backend import use_backend

    path = str(tiny_model_factory("gemma3", **DEPTHS[depth]))
    llm = LLM(path, **ENGINE)
    runner = llm.engine.core.runner
    use_backend(runner, backend)
    assert runner.forward.group_size == {"5 layers": 5, "9 layers": 3}[depth]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [r["token_ids"] for r in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    model = load_reference_model(path)
    assert ours == [reference_greedy(model, prompt, 12) for prompt in PROMPTS]


@pytest.mark.slow
def test_warmed_up_sliding_engine_never_compiles(tiny_model_factory, gemma_cache):
    """Full KV, fixed budgets (sliding layers keep their most recent tokens) and automatic ones in
    one warmed-up engine: nothing compiles; the counter sees compiles where there are some."""
    from engine.test_steady_state import OPTIONS, count_compiles, mixed_workload

    fresh = LLM(str(tiny_model_factory("gemma3", **DEPTHS["9 layers"])), **OPTIONS)
    logged, _ = count_compiles(lambda: mixed_workload(fresh))
    assert logged > 0  # the positive control: a cold engine compiles this workload
    warm = LLM(str(tiny_model_factory("gemma3", **DEPTHS["9 layers"])), warmup=True, **OPTIONS)
    built = warm.engine.core.runner.num_compiles
    logged, _ = count_compiles(lambda: mixed_workload(warm))
    assert logged == 0 and warm.engine.core.runner.num_compiles == built > 0
    assert warm.engine.get_stats().num_compressions > 0
