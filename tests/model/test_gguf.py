"""GGUF: our dequantizers vs gguf's, the name mapping and Q/K un-permutation, bad files, parity."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tiny_models import save_tiny_gguf
from zipage_jax.crosscheck import logits as crosscheck_logits
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.models import gguf as ours
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import flat_params

ROWS, COLS = 6, 512  # two 256-blocks per row for the K quants


def _f16_bytes(rng, n):
    return (rng.standard_normal(n) * 0.05).astype(np.float16).view(np.uint8).reshape(n, 2)


def _reader_data(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random tensor data laid out as GGUFReader hands it over for `qtype`."""
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if qtype not in (Q.Q4_K, Q.Q6_K):
        return gguf.quants.quantize(x, qtype)
    # gguf cannot quantize to K types: random raw blocks with finite f16 scales
    n = ROWS * COLS // 256
    if qtype == Q.Q4_K:  # d, dmin | scales[12] | qs[128]
        blocks = [_f16_bytes(rng, n), _f16_bytes(rng, n), rng.integers(0, 256, (n, 140), dtype=np.uint8)]
    else:  # Q6_K: ql[128] | qh[64] | scales[16] | d
        blocks = [rng.integers(0, 256, (n, 208), dtype=np.uint8), _f16_bytes(rng, n)]
    return np.concatenate(blocks, axis=1).reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantize_matches_gguf(qtype):
    data = _reader_data(qtype, np.random.default_rng(int(qtype)))
    expected = gguf.quants.dequantize(data, qtype)
    got = ours.dequantize(data, qtype)
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS) == expected.shape
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got).max() > 0


def test_dequantize_rejects_unsupported_type():
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q5_K"):
        ours.dequantize(np.zeros((1, 176), np.uint8), Q.Q5_K)


def test_unpermute_undoes_llama_cpp_like_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from tiny_models import _llama_cpp_permute

    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)  # 6 heads of dim 8
    permuted = _llama_cpp_permute(w, 6)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(ours._unpermute(permuted, 6), w)
    np.testing.assert_array_equal(
        ours._unpermute(permuted, 6), LlamaTensorProcessor()._reverse_permute_weights(permuted, 6, 6)
    )


@pytest.fixture(scope="module")
def plain_models(tiny_model_factory):
    """Tiny models GGUF can express (no RoPE scaling)."""
    return {
        "llama": tiny_model_factory("llama", rope_scaling=None),
        "qwen2": tiny_model_factory("qwen2"),
        "qwen3": tiny_model_factory("qwen3"),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_loads_exactly_the_checkpoint(arch, plain_models, tmp_path):
    """Names, Q/K un-permutation and config from GGUF equal the safetensors checkpoint exactly."""
    src = plain_models[arch]
    path = save_tiny_gguf(src, tmp_path / f"{arch}.gguf", qtype="F32")
    from_gguf = load_model(str(path), dtype="float32", cache_dir=str(tmp_path / "cache"))
    from_dir = load_model(str(src), dtype="float32", cache_dir=str(tmp_path / "cache"))
    eps = from_dir.config.rms_norm_eps  # GGUF stores it as float32
    assert from_gguf.config.rms_norm_eps == pytest.approx(eps, rel=1e-7)
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=eps) == from_dir.config
    a, b = flat_params(from_gguf.model), flat_params(from_dir.model)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    text = "Hello there, the end"
    assert from_gguf.tokenizer(text)["input_ids"] == from_dir.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("arch, qtype", [("llama", "Q8_0"), ("qwen2", "Q4_1"), ("llama", "Q4_0")])
def test_quantized_gguf_parity_with_transformers(arch, qtype, plain_models, tmp_path):
    path = save_tiny_gguf(plain_models[arch], tmp_path / f"{arch}.gguf", qtype=qtype)
    loaded = load_model(str(path), dtype="float32", cache_dir=str(tmp_path / "cache"))
    ids = loaded.tokenizer("Hello there, the end of it")["input_ids"]
    result = compare(model_logits(loaded.model, ids), transformers_logits(str(path), ids))
    assert result["ok"] and result["max_abs_diff"] < 1e-4, result


def test_truncated_gguf(plain_models, tmp_path):
    path = save_tiny_gguf(plain_models["llama"], tmp_path / "cut.gguf", qtype="Q8_0")
    os.truncate(path, path.stat().st_size - 1000)
    with pytest.raises(ValueError, match=r"corrupt or truncated GGUF file .*cut\.gguf"):
        load_model(str(path), cache_dir=str(tmp_path / "cache"))


def test_gguf_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"), cache_dir=str(tmp_path / "cache"))


@pytest.mark.slow
def test_default_model_crosscheck(tmp_path, capsys):
    """SmolLM2-135M (Q4_1 + Q8_0 GGUF): our float32 logits vs transformers' GGUF loader."""
    parser = argparse.ArgumentParser()
    crosscheck_logits.add_arguments(parser)
    args = parser.parse_args(["--prompt", "The capital of France is", "--cache-dir", str(tmp_path), "--json"])
    assert crosscheck_logits.run(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["top1_agreement"] == 1.0 and len(result["positions"]) == 5
    assert result["max_abs_diff"] <= result["tolerance"]
