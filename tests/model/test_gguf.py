"""GGUF: files in many tensor types dequantize as gguf-py does, names and Q/K un-permutation, bad files, parity."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from tiny_models import save_tiny_gguf

from zipage_jax.crosscheck import logits as crosscheck_logits
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.models import gguf as ours
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import decoder_from_hf, flat_params

ROWS, COLS = 4, 512  # two 256-blocks per row for the K quants
# Types gguf-py cannot quantize, written as random blocks: the byte offsets of each block's float16 scales.
_F16_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,)}
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, *_F16_SCALES]


def _tensor_data(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """A ROWS x COLS tensor's data in `qtype`: gguf-py's quantization of random values, or random blocks."""
    if qtype not in _F16_SCALES:
        return gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // block_size, type_size), dtype=np.uint8)
    for offset in _F16_SCALES[qtype]:
        scales = (rng.standard_normal((len(blocks), 1)) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(ROWS, -1)


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "qwen2") -> Path:
    """name -> (data, raw tensor type, or None for the type of the data's dtype)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_gguf_file_dequantizes_like_gguf_py(qtype, tmp_path):
    data = _tensor_data(qtype, np.random.default_rng(int(qtype)))
    reader = ours.open_gguf(_write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (data, qtype)}))
    assert [t.tensor_type for t in reader.tensors] == [qtype]
    got = ours.read_tensors(reader, {"model_type": "qwen2"})["model.layers.0.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(data, qtype)  # from the bytes written, not from the file
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS) == expected.shape
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    np.testing.assert_array_equal(got, expected)


def test_gguf_unreadable_type_is_named(tmp_path):
    path = _write_gguf(tmp_path / "i32.gguf", {"blk.0.ffn_up.weight": (np.ones((2, 32), np.int32), None)})
    reader = ours.open_gguf(path)
    assert reader.tensors[0].tensor_type == Q.I32 and Q.I32 not in ours.readable_types()
    with pytest.raises(ValueError, match="unsupported GGUF tensor type I32: gguf-py cannot dequantize it"):
        ours.read_tensors(reader, {"model_type": "qwen2"})


def test_unpermute_undoes_llama_cpp_like_transformers():
    from tiny_models import _llama_cpp_permute
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

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


def test_q5_0_gguf_model_loads_gguf_py_dequantization(plain_models, tmp_path):
    """A whole Q5_0 model: its decoder parameters are exactly gguf-py's dequantization of the file."""
    path = save_tiny_gguf(plain_models["qwen2"], tmp_path / "q5_0.gguf", qtype="Q5_0")  # qwen2: no Q/K permute
    loaded = load_model(str(path), dtype="float32", cache_dir=str(tmp_path / "cache"))
    reader = gguf.GGUFReader(path)
    assert Q.Q5_0 in {t.tensor_type for t in reader.tensors}
    expected = {
        ours.hf_name(t.name): gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        for t in reader.tensors
    }
    a = flat_params(loaded.model)
    b = flat_params(decoder_from_hf(loaded.config, jnp.dtype(jnp.float32), expected))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


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
    path = _write_gguf(tmp_path / "gpt2.gguf", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)}, "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(path), cache_dir=str(tmp_path / "cache"))


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
