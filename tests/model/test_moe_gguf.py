"""Qwen3-MoE and Mixtral from GGUF as llama.cpp writes them ("qwen3moe"; "llama" with experts and
permuted Q/K): stacked expert tensors in ggml's axis order (or one per expert, older Mixtral files),
the experts' metadata, quantized experts; parameters, logits and greedy tokens equal the safetensors
checkpoint's."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_models import save_tiny_gguf

from zipage_jax import LLM, SamplingParams
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.models import gguf as ours
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import flat_params

pytest.importorskip("torch")

# llama.cpp always renormalises Qwen3-MoE's top-k weights: the checkpoint must too to be comparable
OVERRIDES = {"qwen3_moe": dict(norm_topk_prob=True), "mixtral": {}}
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
PROMPT_IDS = [1, 42, 71, 78, 78, 81, 223, 89, 81, 84, 78, 70, 14, 300, 5, 2, 260]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37]
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory, model_cache_dir):
    """arch -> its tiny safetensors checkpoint; converted parameters in the session's private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield {arch: tiny_model_factory(arch, **overrides) for arch, overrides in OVERRIDES.items()}
    mp.undo()


def _load_both(src, path, cache):
    return (load_model(str(path), dtype="float32", cache_dir=str(cache)),
            load_model(str(src), dtype="float32", cache_dir=str(cache)))


@pytest.mark.parametrize(("arch", "per_expert"), [("qwen3_moe", False), ("mixtral", False), ("mixtral", True)],
                         ids=["qwen3_moe", "mixtral", "mixtral-per-expert"])
def test_f32_moe_gguf_loads_exactly_the_checkpoint(arch, per_expert, checkpoints, model_cache_dir, tmp_path):
    """The file is laid out as llama.cpp's (ggml dims [in, out, experts]); config, every parameter and
    the logits equal the checkpoint's (transformers' on the safetensors)."""
    src = checkpoints[arch]
    path = save_tiny_gguf(src, tmp_path / f"{arch}.gguf", per_expert=per_expert)
    reader = ours.open_gguf(path)
    assert ours.field_value(reader, "general.architecture") == GGUF_ARCH[arch]
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    from_gguf, from_dir = _load_both(src, path, model_cache_dir)
    cfg = from_dir.config
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    assert shapes["blk.1.ffn_gate_inp.weight"] == [H, E]
    if per_expert:
        assert shapes["blk.1.ffn_up.3.weight"] == [H, I] and shapes["blk.1.ffn_down.3.weight"] == [I, H]
        assert not any("_exps" in name for name in shapes)
    else:
        assert shapes["blk.1.ffn_up_exps.weight"] == [H, I, E] and shapes["blk.1.ffn_down_exps.weight"] == [I, H, E]
    assert from_gguf.config.architecture == arch and from_gguf.config.norm_topk_prob
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=cfg.rms_norm_eps) == cfg
    a, b = flat_params(from_gguf.model), flat_params(from_dir.model)
    assert a.keys() == b.keys() and a["layers.1.mlp.experts.up_proj"].shape == (E, H, I)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    result = compare(model_logits(from_gguf.model, PROMPT_IDS), transformers_logits(str(src), PROMPT_IDS))
    assert result["ok"] and result["max_abs_diff"] < 1e-4, result


def test_q8_0_experts_dequantize_like_gguf_py(checkpoints, model_cache_dir, tmp_path):
    """Stacked 3-D expert tensors in Q8_0 load as gguf-py's dequantization of the file's bytes (the
    router stays F32, as llama.cpp keeps it), off the checkpoint by Q8_0's rounding only."""
    src = checkpoints["qwen3_moe"]
    path = save_tiny_gguf(src, tmp_path / "q8_0.gguf", qtype="Q8_0")
    tensors = {t.name: t for t in ours.open_gguf(path).tensors}
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32
    from_gguf, from_dir = _load_both(src, path, model_cache_dir)
    got, exact = flat_params(from_gguf.model), flat_params(from_dir.model)
    for layer in range(from_dir.config.num_layers):
        for proj in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert t.tensor_type == Q.Q8_0 and len(t.shape) == 3
            expected = gguf.quants.dequantize(t.data, Q.Q8_0).reshape(tuple(reversed(t.shape.tolist())))  # [E, out, in]
            key = f"layers.{layer}.mlp.experts.{proj}_proj"  # [E, in, out]
            np.testing.assert_array_equal(got[key], expected.transpose(0, 2, 1), err_msg=key)
            error = np.abs(np.asarray(got[key]) - np.asarray(exact[key])).max()
            assert 0 < error < 0.01 * np.abs(np.asarray(exact[key])).max(), key  # quantized, only rounded


def _metadata_only_gguf(path, **experts) -> gguf.GGUFReader:
    """A qwen3moe file with the dense metadata and the given expert keys (add_<key>=value)."""
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_vocab_size(320)
    for key, value in experts.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return ours.open_gguf(path)


def test_qwen3moe_expert_metadata_is_required(tmp_path):
    complete = dict(expert_count=8, expert_used_count=2, expert_feed_forward_length=32)
    config = ours.hf_config(_metadata_only_gguf(tmp_path / "ok.gguf", **complete))
    assert (config["architectures"], config["num_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["norm_topk_prob"]) == (["Qwen3MoeForCausalLM"], 8, 2, 32, True)
    for missing in complete:
        reader = _metadata_only_gguf(tmp_path / f"no_{missing}.gguf",
                                     **{k: v for k, v in complete.items() if k != missing})
        with pytest.raises(ValueError, match=f"GGUF file has no qwen3moe.{missing}"):
            ours.hf_config(reader)


def test_llama_without_experts_stays_llama(checkpoints, tiny_model_factory, tmp_path):
    """Only a "llama" file with experts is Mixtral."""
    dense = ours.open_gguf(save_tiny_gguf(tiny_model_factory("llama", rope_scaling=None), tmp_path / "l.gguf"))
    mixtral = ours.open_gguf(save_tiny_gguf(checkpoints["mixtral"], tmp_path / "m.gguf"))
    assert ours.gguf_architecture(dense) == "LlamaForCausalLM"
    assert ours.gguf_architecture(mixtral) == "MixtralForCausalLM"
    cfg = ModelConfig.from_hf(ours.hf_config(mixtral))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 48)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_engine_greedy_tokens_match_the_checkpoint(arch, checkpoints, tmp_path):
    src = checkpoints[arch]
    path = save_tiny_gguf(src, tmp_path / f"{arch}.gguf")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [[r["token_ids"] for r in LLM(str(model), **ENGINE).generate(PROMPTS, greedy, use_tqdm=False)]
              for model in (path, src)]
    assert tokens[0] == tokens[1] and len(set(map(tuple, tokens[0]))) == len(PROMPTS)
